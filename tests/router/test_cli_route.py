"""``kvpool route``'s command line: bad flags are refused by name before anything starts."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kvpool.cli.commands import cli


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["route", *args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def test_a_replica_is_required() -> None:
    code, out = run()
    assert code == 2 and "--replica" in out


def test_a_replica_url_must_be_a_bare_http_base() -> None:
    for url in ("127.0.0.1:8001", "ftp://h:1", "http://h:1/v1", "http://h:notaport"):
        code, out = run("--replica", url)
        assert code == 2 and "kvpool route: error:" in out and repr(url) in out, out


def test_a_bad_load_cost_or_secret_file_is_refused(tmp_path: Path) -> None:
    code, out = run("--replica", "http://127.0.0.1:1", "--load-cost", "0")
    assert code == 2 and "--load-cost" in out
    short = tmp_path / "secret"
    short.write_text("too short")
    code, out = run("--replica", "http://127.0.0.1:1", "--tenant-secret-file", str(short))
    assert code == 2 and "at least 16" in out


def test_an_unreachable_index_redis_is_refused(tmp_path: Path) -> None:
    code, out = run(
        "--replica", "http://127.0.0.1:1", "--no-tenant-isolation", "--index-redis", "redis://127.0.0.1:1/0"
    )
    assert code == 2 and "does not answer" in out


def test_an_empty_admin_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "admin"
    empty.write_text("\n")
    code, out = run("--replica", "http://127.0.0.1:1", "--no-tenant-isolation", "--admin-key-file", str(empty))
    assert code == 2 and "holds no key" in out


def test_the_index_caps_default_to_the_librarys():
    from kvpool.cli.route import route
    from kvpool.router.index import MAX_BLOCKS, MAX_BLOCKS_PER_REPLICA

    defaults = {p.name: p.default for p in route.params}
    assert defaults["index_max_blocks"] == MAX_BLOCKS
    assert defaults["index_max_blocks_per_replica"] == MAX_BLOCKS_PER_REPLICA
