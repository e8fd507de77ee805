"""Plain ``kvpool simulate`` without the ``fast`` extra: the standard library's hash, one warning, the same figures.

Each run is a fresh interpreter in which ``xxhash`` cannot be imported (a finder first on
``sys.meta_path`` refuses it), as on an install of kvpool without its extras.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.errors import ConfigError
from kvpool.sim.options import FALLBACK_HASH, FAST_HASH, SimulateOptions
from tests.helpers import without_modules

ARGS = ["simulate", "synthetic:multi_turn", "--requests", "40", "--kv-blocks", "300"]

PRELUDE = without_modules("xxhash", announce=False)


def simulate(*args: str, fast: bool) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n" + ("" if fast else PRELUDE) + f"from kvpool.cli import main\nsys.exit(main({[*ARGS, *args]!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_it_runs_with_the_standard_librarys_hash_and_says_so_once() -> None:
    without = simulate("--json", fast=False)
    assert without.returncode == 0, without.stderr
    warnings = [line for line in without.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, without.stderr
    assert FALLBACK_HASH in warnings[0] and "pip install 'kvpool[fast]'" in warnings[0]
    figures = json.loads(without.stdout)
    pytest.importorskip("xxhash")
    fast = simulate("--json", fast=True)
    assert fast.returncode == 0, fast.stderr
    assert "warning" not in fast.stderr
    faster = json.loads(fast.stdout)
    for run in (figures, faster):
        del run["simulation"]["wall_seconds"]  # the one figure of this machine, not of the replay
    assert faster == figures  # hit rates do not depend on the hash


def test_asking_for_xxh3_128_without_it_names_the_extra() -> None:
    result = simulate("--hash", FAST_HASH, fast=False)
    assert result.returncode != 0
    assert f"--hash {FAST_HASH} needs the xxhash package: pip install 'kvpool[fast]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_options_choose_the_fastest_hash_installed() -> None:
    options = SimulateOptions(trace="synthetic:multi_turn", kv_blocks=10)
    assert options.hash_algo is None and options.block_hash in {FAST_HASH, FALLBACK_HASH}
    assert SimulateOptions(trace="synthetic:multi_turn", kv_blocks=10, hash_algo="sha256").block_hash == "sha256"
    with pytest.raises(ConfigError, match="'md5'"):
        SimulateOptions(trace="synthetic:multi_turn", kv_blocks=10, hash_algo="md5")
