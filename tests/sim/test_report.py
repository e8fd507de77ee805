"""``kvpool simulate --report DIR``: one page, readable offline, every chart's data beside it; sweep records too."""

from __future__ import annotations

import csv
import json
import re

import pytest
from click.testing import CliRunner

from kvpool.cli.commands import cli
from kvpool.errors import ConfigError

pytest.importorskip("matplotlib")

from kvpool.sim.sweep_charts import load_records, sweep_sections, write_sweep_report  # noqa: E402


def simulate(*args: str, requests: int = 20):
    base = ["simulate", "synthetic:multi_turn", "--requests", str(requests), "--kv-blocks", "300"]
    return CliRunner().invoke(cli, [*base, *args])


def check_page(directory) -> list[dict]:
    """The page is whole and offline, and each chart's labels, data files and inline SVG are there."""
    page = (directory / "index.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from elsewhere
    figures = json.loads((directory / "figures.json").read_text())
    for figure in figures:
        assert f'data-chart="{figure["name"]}"' in page
        for axes in figure["axes"]:
            assert axes["xlabel"] and (axes["ylabel"] or axes["kind"] == "secondary"), figure
            assert f">{axes['xlabel']}<" in page.replace("&#x27;", "'")  # drawn as SVG text
        with (directory / f"{figure['name']}.csv").open() as data:
            rows = list(csv.reader(data))
        assert len(rows) > 1
        assert json.loads((directory / f"{figure['name']}.json").read_text())["points"]
    return figures


def test_a_single_replay_reports_its_figures_and_timeline(tmp_path):
    result = simulate("--report", str(tmp_path / "r"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["report"] == str(tmp_path / "r" / "index.html")
    figures = check_page(tmp_path / "r")
    assert [f["name"] for f in figures] == ["usage"]
    page = (tmp_path / "r" / "index.html").read_text()
    assert "token hit rate" in page and "pool 300 blocks x 16 tokens, policy lru, no tier, 1 replica" in page


def test_replicas_report_the_rules_side_by_side(tmp_path):
    result = simulate("--replicas", "2", "--routing", "prefix", "--routing", "round-robin", "--report", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert [f["name"] for f in check_page(tmp_path)] == ["usage", "routing"]
    assert "Routing rules side by side" in (tmp_path / "index.html").read_text()


def test_a_sizing_search_reports_the_cheapest_fleet(tmp_path):
    result = simulate("--ttft-slo", "30s", "--max-replicas", "2", "--routing", "prefix", "--report", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert [f["name"] for f in check_page(tmp_path)] == ["sizing"]
    page = (tmp_path / "index.html").read_text()
    assert "cheapest fleet meeting it" in page and "objective: p90 &lt;= 30 s" in page


def test_a_report_to_a_file_is_refused_by_name(tmp_path):
    target = tmp_path / "taken"
    target.write_text("")
    result = simulate("--report", str(target))
    assert result.exit_code == 2
    assert f"--report {str(target)!r} is a file" in result.stderr


def _record(**settings):
    replicas, pool = settings.get("replicas", 1), settings.pop("kv_blocks", 1000)
    rate = settings.get("rate_scale", 1.0)
    summary = {
        "num_blocks": pool + 1,
        "block_size": 16,
        "policy": settings.get("policy", "lru"),
        "replicas": replicas,
        "routing": settings.get("routing", "prefix"),
        "token_hit_rate": pool / 10_000 + (0.05 if settings.get("routing") == "prefix" else 0.0),
        "ttft_p50_s": rate / replicas,
        "ttft_p90_s": 2 * rate / replicas,
        "ttft_p99_s": 3 * rate / replicas,
        "overloaded": rate / replicas > 2,
    }
    return {"settings": settings, "summary": summary}


def test_sweep_records_give_the_cheapest_fleet_per_load_and_the_comparisons(tmp_path):
    records = [
        _record(replicas=n, routing=rule, rate_scale=load, ttft_slo=1.0)
        for n in (1, 2, 4, 8)
        for rule in ("prefix", "round-robin")
        for load in (1.0, 2.0)
    ]
    records += [_record(kv_blocks=b, policy=p) for b in (500, 2000, 8000) for p in ("lru", "frequency")]
    records += [_record(tier=["cpu:4GiB"])]
    sections = sweep_sections(records)
    titles = [s.title for s in sections]
    assert titles[1] == "The cheapest fleet meeting the objective, per load level"
    assert dict(sections[1].facts) == {
        "load x1": "2 replicas (prefix, round-robin)",
        "load x2": "4 replicas (prefix, round-robin)",
    }
    assert "Hit rate and TTFT against pool size, per policy" in titles and "Routing rules side by side" in titles
    assert any(t.startswith("Tier benefit") for t in titles)
    lines = tmp_path / "records.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_sweep_report(load_records(lines), tmp_path / "page")
    names = [f["name"] for f in check_page(page.parent)]
    assert names == [
        "sweep_cheapest",
        "sweep_token_hit_rate_by_pool",
        "sweep_ttft_p90_s_by_pool",
        "sweep_routing",
        "sweep_tiers",
    ]


def test_a_record_without_the_summary_is_refused_by_name():
    with pytest.raises(ConfigError, match="sweep record 1 has no 'num_blocks'"):
        sweep_sections([_record(), {"settings": {"replicas": 2}, "summary": {"policy": "lru"}}])


def test_a_report_folder_that_cannot_be_made_is_refused_by_name(tmp_path):
    (tmp_path / "taken").write_text("")
    result = simulate("--report", str(tmp_path / "taken" / "below"))
    assert result.exit_code == 2 and "cannot be created" in result.stderr
    assert str(tmp_path / "taken" / "below") in result.stderr and "Traceback" not in result.output


def test_records_that_are_not_json_objects_are_named_by_line(tmp_path):
    lines = tmp_path / "records.jsonl"
    lines.write_text(json.dumps(_record()) + "\n\n[1, 2]\n")
    with pytest.raises(ConfigError, match=r"records\.jsonl:3 is not a JSON object"):
        load_records(lines)
    lines.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"records\.jsonl:1 is not JSON"):
        load_records(lines)
    with pytest.raises(ConfigError, match="at least one record"):
        sweep_sections([])


def test_an_overloaded_replay_says_so_on_the_page_and_on_its_timeline(tmp_path):
    base = ["simulate", "synthetic:shared_prefix", "--requests", "40", "--kv-blocks", "2000"]
    result = CliRunner().invoke(cli, [*base, "--prefill-us-per-token", "2000", "--report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "index.html").read_text()
    assert '<dd class="overloaded">OVERLOADED: ' in page
    svg = page[page.index('data-chart="usage"') :]
    assert ">OVERLOADED: " in svg  # drawn in the timeline's SVG, not only written beside it


def test_settings_may_sit_beside_the_summary():
    nested = _record(replicas=2, routing="prefix", rate_scale=3.0, ttft_slo=5.0)
    flat = {**nested["settings"], "summary": nested["summary"]}
    from kvpool.sim.sweep_charts import sweep_points

    (a,), (b,) = sweep_points([nested]), sweep_points([flat])
    assert a == b and b.load == 3.0 and b.ttft_slo == 5.0


def test_a_sweeps_results_file_becomes_records_one_per_configuration_and_rule() -> None:
    from kvpool.sim.sweep_charts import records_of_results

    summary = {"token_hit_rate": 0.5}
    results = [
        {
            "index": 0,
            "key": "k0",
            "config": {"kv_blocks": 300, "arrival-rate-scale": 2.0, "ttft-slo": 1.5, "tier": ["cpu:1GiB"]},
            "figures": {"requests": 4, "routing": {"prefix": summary, "round-robin": summary}},
        },
        {"index": 1, "key": "k1", "config": {"kv-blocks": 600}, "figures": {"requests": 4, "sequential": {}}},
    ]
    records = records_of_results(results)
    settings = {"rate_scale": 2.0, "tier": ["cpu:1GiB"], "ttft_slo": 1.5}
    assert records == [{"settings": settings, "summary": summary}] * 2  # the sequential replay gives none
