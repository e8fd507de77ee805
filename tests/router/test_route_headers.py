"""Through ``kvpool route`` a client gets one ``date`` and one ``server`` header (issue 30): the router's own,
not the replica's copied beside them."""

from __future__ import annotations

from tests.router.fakes import FakeReplica, wait_for
from tests.router.test_route import SALTS, ask, route, system, up


def test_a_routed_answer_carries_one_date_and_one_server_header() -> None:
    replica = FakeReplica("r0", SALTS).start()
    router = route([replica])
    try:
        wait_for(lambda: up(router), "the replica up")
        direct = router.client.get(f"{replica.url}/v1/models")
        assert len(direct.headers.get_list("date")) == 1  # the replica's own server writes them
        answers = [
            router.chat([system(0), ask("hello")]),
            router.chat([system(1), ask("hello")], stream=True),
            router.client.get("/v1/models"),
        ]
        for reply in answers:
            assert reply.status_code == 200, reply.text
            assert len(reply.headers.get_list("date")) == 1, reply.headers
            assert len(reply.headers.get_list("server")) == 1, reply.headers
        assert all(reply.headers["x-kvpool-replica"] == replica.url for reply in answers[:2])
    finally:
        router.stop()
        replica.kill()
