"""The same small grid, serial, in a 2-process pool and as Ray tasks: the same figures, bit for bit.

Ray is the ``ray`` extra: without it the Ray test skips with the reason, except under ``CI=true``
(CI installs every extra), where it fails, as the Redis tests do (``tests/services.py``). One local
Ray (``num_cpus=2``) is started for this module and shut down after it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.errors import ConfigError
from kvpool.sim.sweep import Sweep
from kvpool.sim.sweep_executors import PoolExecutor, RayExecutor, SerialExecutor, SweepExecutor, executor_for
from kvpool.sim.sweep_results import SweepResults, read_results
from kvpool.sim.sweep_runner import run_sweep
from tests.services import unavailable

#: Four configurations that differ in every figure that matters: pool size, policy, replicas, load, tiers.
GRID = {"kv-blocks": [150, 600], "policy": ["lru", "frequency"], "replicas": [2], "tier": [["cpu:64MiB"]]}
BASE = {"trace": "synthetic:multi_turn", "requests": 16, "routing": ()}


def results_of(executor: SweepExecutor, folder: Path) -> list[dict[str, Any]]:
    out = folder / "out.jsonl"
    out.unlink(missing_ok=True)
    run_sweep(Sweep.from_grid(GRID, BASE), executor, SweepResults(out))
    return [{"config": r["config"], "figures": r["figures"]} for r in read_results(out)]


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> str:
    return json.dumps(results_of(SerialExecutor(), tmp_path_factory.mktemp("serial")), sort_keys=True)


def test_serial_and_a_two_process_pool_give_the_same_figures(serial: str, tmp_path: Path) -> None:
    pooled = results_of(PoolExecutor(2), tmp_path)
    assert len(pooled) == 4
    assert json.dumps(pooled, sort_keys=True) == serial


@pytest.fixture(scope="module")
def ray_session() -> Iterator[Any]:
    if importlib.util.find_spec("ray") is None:
        unavailable("ray is not installed (pip install 'kvpool[ray]')")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_ray_tasks_give_the_same_figures(ray_session: Any, serial: str, tmp_path: Path) -> None:
    on_ray = results_of(RayExecutor("auto"), tmp_path)  # Ray is initialised: the tasks run on its node
    assert len(on_ray) == 4
    assert json.dumps(on_ray, sort_keys=True) == serial
    assert ray_session.is_initialized()  # left running: it was not this executor's to stop


def test_workers_choose_the_executor() -> None:
    assert isinstance(executor_for(workers=1, ray=None), SerialExecutor)
    assert isinstance(executor_for(workers=3, ray=None), PoolExecutor)
    assert isinstance(executor_for(workers=None, ray="local"), RayExecutor)
    with pytest.raises(ConfigError, match="--workers must be a positive integer, got 0"):
        executor_for(workers=0, ray=None)
    with pytest.raises(ConfigError, match="--ray must be a cluster address"):
        RayExecutor(" ")


def test_the_simulator_imports_without_ray() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"  # an import of ray would fail
        "import kvpool.sim.sweep, kvpool.sim.sweep_executors, kvpool.sim.sweep_runner, kvpool.sim.study\n"
        "assert sys.modules['ray'] is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_replay_with_tiers_does_not_hang_on_the_string_hash_seed() -> None:
    """Tier transfers report sets of request IDs; their order (the process's hash seed) must not reach a figure."""
    code = (
        "import json\n"
        "from kvpool.sim.sweep import Sweep\n"
        f"print(json.dumps(Sweep.from_grid({GRID!r}, {BASE!r}).jobs[0].run(), sort_keys=True))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1
