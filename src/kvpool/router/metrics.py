"""The router's ``/metrics``: Prometheus' text format, written out (no client library needed).

Per replica (label ``replica``, its URL, credentials redacted):

* ``kvpool_router_replica_up`` (1/0), ``kvpool_router_replica_in_flight``,
  ``kvpool_router_replica_prefix_source`` (label ``source``: precise, approximate or
  load), ``kvpool_router_replica_hash_check`` (label ``verdict``; ``unmatched`` or
  ``silent`` say its described settings are wrong);
* ``kvpool_router_requests_total``, ``kvpool_router_transport_errors_total``,
  ``kvpool_router_server_errors_total`` (answers of 500 or more),
  ``kvpool_router_ejections_total`` (times passive health took it out of rotation),
  ``kvpool_router_replica_consecutive_failures`` (failed answers since its last good one),
  ``kvpool_router_prompt_tokens_total``;
* ``kvpool_router_predicted_cached_tokens_total`` (every request routed) and, over the
  answers that reported ``cached_tokens``: ``kvpool_router_reported_cached_tokens_total``,
  ``kvpool_router_predicted_reported_cached_tokens_total`` (the prediction for those same
  answers: the two compare), ``kvpool_router_reports_total``,
  ``kvpool_router_exact_predictions_total``;
* ``kvpool_router_index_blocks`` (the events' index), ``kvpool_router_approx_blocks``
  (the router's memory);
* ``kvpool_router_event_batches_total``, ``kvpool_router_event_blocks_stored_total``,
  ``kvpool_router_event_gaps_total``, ``kvpool_router_event_lost_batches_total``,
  ``kvpool_router_event_restarts_total``, ``kvpool_router_event_errors_total``,
  ``kvpool_router_event_snapshots_total``, ``kvpool_router_event_snapshot_errors_total``,
  ``kvpool_router_event_lag_seconds`` (the newest live batch: applied minus published).

And ``kvpool_router_no_replica_total`` (requests answered 503 with no replica up).

Routing regret, over the requests routed by prefix (docs/routing.md, "Routing regret"):
``kvpool_router_cached_tokens_achieved_total`` (the cached tokens the chosen replica held),
``kvpool_router_cached_tokens_best_available_total`` (the most any replica up held),
``kvpool_router_regret_requests_total``, and the histogram ``kvpool_router_cached_tokens_ratio``
of achieved / best-available per request (requests with a best above 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvpool.router.index import BlockIndex
from kvpool.router.monitor import ReplicaMonitor
from kvpool.router.ranking import REGRET_BUCKETS, Ranker
from kvpool.router.replicas import Replica
from kvpool.router.stats import HashVerdict

__all__ = ["MetricsSource", "render_metrics"]


class MetricsSource(Protocol):
    """What the metrics read of a router (:class:`kvpool.router.front_door.Router` is one)."""

    @property
    def replicas(self) -> Sequence[Replica]: ...

    @property
    def monitor(self) -> ReplicaMonitor: ...

    @property
    def index(self) -> BlockIndex: ...

    @property
    def approx(self) -> BlockIndex: ...

    @property
    def no_replica(self) -> int: ...

    @property
    def ranker(self) -> Ranker: ...

    def precise_for(self, replica: Replica) -> bool: ...

    def approximate_for(self, replica: Replica) -> bool: ...


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(router: MetricsSource) -> str:
    """The text of ``/metrics`` for ``router`` (see the module)."""
    lines: list[str] = []

    def family(name: str, kind: str, text: str, value: Callable[[Replica], float | int]) -> None:
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        for replica in router.replicas:
            lines.append(f'{name}{{replica="{_label(replica.url)}"}} {value(replica)}')

    def labelled(name: str, text: str, label: str, values: Iterable[str], current: Callable[[Replica], str]) -> None:
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} gauge")
        for replica in router.replicas:
            mine = current(replica)
            for value in values:
                lines.append(f'{name}{{replica="{_label(replica.url)}",{label}="{value}"}} {int(value == mine)}')

    def feed(replica: Replica, figure: str) -> float | int:
        found = router.monitor.feeds.get(replica.url)
        return 0 if found is None else getattr(found, figure)

    def source(replica: Replica) -> str:
        if router.precise_for(replica):
            return "precise"
        return "approximate" if router.approximate_for(replica) else "load"

    family("kvpool_router_replica_up", "gauge", "1 while the replica is in rotation.", lambda r: int(r.up))
    family("kvpool_router_replica_in_flight", "gauge", "Requests in flight at the replica.", lambda r: r.in_flight)
    family(
        "kvpool_router_replica_consecutive_failures",
        "gauge",
        "Failed answers (5xx, broken connections) since its last good one.",
        lambda r: r.consecutive_failures,
    )
    labelled(
        "kvpool_router_replica_prefix_source",
        "Where the replica's cached prefixes are learnt.",
        "source",
        ("precise", "approximate", "load"),
        source,
    )
    labelled(
        "kvpool_router_replica_hash_check",
        "Whether the replica's events name the blocks of the prompts sent to it.",
        "verdict",
        [v.value for v in HashVerdict],
        lambda r: r.stats.verdict.value,
    )
    counters: list[tuple[str, str, Callable[[Replica], int]]] = [
        ("requests_total", "Requests the replica answered.", lambda r: r.stats.requests),
        ("transport_errors_total", "Requests that failed to reach it.", lambda r: r.stats.transport_errors),
        ("server_errors_total", "Answers with a status of 500 or more.", lambda r: r.stats.server_errors),
        ("ejections_total", "Times failed answers in a row took it out of rotation.", lambda r: r.ejected),
        ("prompt_tokens_total", "Prompt tokens routed to it.", lambda r: r.stats.prompt_tokens),
        (
            "predicted_cached_tokens_total",
            "Prompt tokens the router predicted it would serve from cache.",
            lambda r: r.stats.predicted_cached_tokens,
        ),
        ("reports_total", "Answers that reported cached_tokens.", lambda r: r.stats.reports),
        (
            "reported_cached_tokens_total",
            "cached_tokens the replica reported.",
            lambda r: r.stats.reported_cached_tokens,
        ),
        (
            "predicted_reported_cached_tokens_total",
            "The router's prediction for the answers that reported cached_tokens.",
            lambda r: r.stats.predicted_reported,
        ),
        ("exact_predictions_total", "Answers whose cached_tokens equalled the prediction.", lambda r: r.stats.exact),
    ]
    for name, text, value in counters:
        family(f"kvpool_router_{name}", "counter", text, value)
    family(
        "kvpool_router_index_blocks",
        "gauge",
        "Blocks its events say it holds.",
        lambda r: router.index.num_blocks(r.url),
    )
    family(
        "kvpool_router_approx_blocks",
        "gauge",
        "Blocks the router remembers sending it.",
        lambda r: router.approx.num_blocks(r.url),
    )
    for name, kind, text, figure in (
        ("event_batches_total", "counter", "Event batches applied.", "batches"),
        ("event_blocks_stored_total", "counter", "Blocks its events stored.", "stored"),
        ("event_gaps_total", "counter", "Breaks in its event sequence that could not be replayed.", "gaps"),
        ("event_lost_batches_total", "counter", "Event batches lost in those breaks.", "lost"),
        ("event_restarts_total", "counter", "Times its event sequence started over.", "restarts"),
        ("event_errors_total", "counter", "Faults of its event stream (bad messages, sockets).", "errors"),
        ("event_snapshots_total", "counter", "Snapshots of its pool loaded where replay could not cover.", "snapshots"),
        ("event_snapshot_errors_total", "counter", "Snapshots that could not be loaded.", "snapshot_errors"),
        ("event_lag_seconds", "gauge", "The newest live batch: applied minus published.", "lag"),
    ):
        family(f"kvpool_router_{name}", kind, text, lambda r, f=figure: feed(r, f))  # type: ignore[misc]  # bound
    regret = router.ranker.regret
    for name, text, total in (
        (
            "cached_tokens_achieved_total",
            "Cached tokens the chosen replicas held, over requests routed.",
            regret.achieved_tokens,
        ),
        (
            "cached_tokens_best_available_total",
            "The most cached tokens any replica up held, over the same requests.",
            regret.best_tokens,
        ),
        ("regret_requests_total", "Requests routed by prefix (those the two above count).", regret.requests),
    ):
        lines.append(f"# HELP kvpool_router_{name} {text}")
        lines.append(f"# TYPE kvpool_router_{name} counter")
        lines.append(f"kvpool_router_{name} {total}")
    ratio = "kvpool_router_cached_tokens_ratio"
    lines.append(f"# HELP {ratio} Per request, cached tokens achieved / best available (a best above 0).")
    lines.append(f"# TYPE {ratio} histogram")
    below = 0
    for bound, count in zip(REGRET_BUCKETS, regret.buckets):
        below += count
        lines.append(f'{ratio}_bucket{{le="{bound}"}} {below}')
    lines.append(f'{ratio}_bucket{{le="+Inf"}} {regret.ratios}')
    lines.append(f"{ratio}_sum {regret.ratio_sum}")
    lines.append(f"{ratio}_count {regret.ratios}")
    lines.append("# HELP kvpool_router_no_replica_total Requests answered 503 because no replica was up.")
    lines.append("# TYPE kvpool_router_no_replica_total counter")
    lines.append(f"kvpool_router_no_replica_total {router.no_replica}")
    return "\n".join(lines) + "\n"
