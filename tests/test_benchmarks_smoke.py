"""The peer benchmarks run on tiny inputs, without vLLM or SGLang installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_manager  # noqa: E402
import bench_radix  # noqa: E402
import bench_scaling  # noqa: E402


def test_production_mix_salts_a_fifth_and_replays(capsys):
    conversations = bench_manager.make_workload(60, seed=3, salted_fraction=0.2)
    salted = [c for c in conversations if c.salt is not None]
    assert len(salted) == round(0.2 * len(conversations))
    plain = bench_manager.make_workload(60, seed=3)
    assert [c.system for c in plain] == [c.system for c in conversations]  # salts leave the tokens alone
    t = bench_manager.replay(bench_manager.KVPoolAdapter(400), conversations, record=True, max_running=8)
    assert t.finished == 60 and t.queries > 0
    phases = bench_manager.phase_totals(t)
    assert phases["total"] == phases["manager"] + phases["hashing"] > 0


def _tiny_trace(path: Path) -> Path:
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_long_prompt_replay(tmp_path):
    prompts = bench_manager.load_long_prompts(_tiny_trace(tmp_path / "t.jsonl"), 10)
    assert [len(p) for p in prompts] == [1000, 1200, 700]
    for algo in ("sha256", "xxh3_128"):
        runs = [bench_manager.replay_long_prompts(prompts, algo, cache_tokens=2048) for _ in range(2)]
        r = bench_manager.median_runs(runs)
        assert r["tokens"] == 2900 and r["requests"] == 3
        assert r["hits"] == 992 + 512  # request 2: blocks 0 and 1 (62 of 16 tokens); request 3: block 0
        assert set(r["ns"]) == set(bench_manager.LONG_PROMPT_PHASES)


def test_radix_bench_stand_ins_are_inert():
    finder = bench_radix._StandInFinder(("fake_gpu_kernels",))
    sys.meta_path.insert(0, finder)
    try:
        import fake_gpu_kernels.language as tl  # noqa: PLC0415

        @tl.jit
        def kernel(x):
            return x + 1

        assert kernel(1) == 2  # a decorator stand-in leaves the function alone
        assert isinstance(tl.constexpr, type) and tl.constexpr[3] is tl.constexpr
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if m.startswith("fake_gpu_kernels")]:
            del sys.modules[name]


def test_scaling_measures_a_small_pool():
    r = bench_scaling.measure(1000, batch=5, repeats=1)
    assert r["free_after"] == 1000
    assert all(r[p] > 0 for p in bench_scaling.PHASES)


def test_long_prompt_replay_on_the_cpu_clock(tmp_path, monkeypatch):
    prompts = bench_manager.load_long_prompts(_tiny_trace(tmp_path / "t.jsonl"), 10)
    calls = []

    def counting_clock() -> int:
        calls.append(1)
        return len(calls)

    monkeypatch.setitem(bench_manager.CLOCKS, "cpu", counting_clock)
    monkeypatch.setattr(bench_manager, "clock_ns", bench_manager.clock_ns)
    bench_manager.use_clock("cpu")
    r = bench_manager.replay_long_prompts(prompts, "xxh3_128", cache_tokens=2048)
    assert len(calls) == 6 * 3  # six readings per request, all from the chosen clock
    assert r["ns"] == {"hash": 3, "lookup": 3, "allocate": 3, "free": 3}  # each phase spans one tick per request


def test_sweep_bench_checks_every_executor_against_serial(tmp_path, capsys):
    import bench_sweep  # noqa: PLC0415

    from kvpool.sim.sweep import Sweep  # noqa: PLC0415
    from kvpool.sim.sweep_executors import PoolExecutor, SerialExecutor  # noqa: PLC0415

    sweep = Sweep.from_grid({"kv-blocks": [100, 200]}, {"trace": "synthetic:multi_turn", "requests": 8})
    times = bench_sweep.measure(sweep, {"serial": SerialExecutor(), "pool": PoolExecutor(2)}, 1, tmp_path)
    assert set(times) == {"serial", "pool"} and all(len(t) == 1 for t in times.values())
    bench_sweep.report(times, len(sweep.jobs), 2)
    assert "16-core estimate" in capsys.readouterr().out
