"""The examples run and print what the README promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reference_scenario_example():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reference_scenario.py")], capture_output=True, text=True, check=True
    )
    out = result.stdout
    assert "[5, 7, 8, 9, 10, 11, 4, 6, 3, 2, 1]" in out
    assert "D  tokens=16  cached=12  to compute=4   blocks=[1, 2, 3, 10]" in out
    assert "C  tokens=16  cached=0   to compute=16  blocks=[5, 7, 8, 9]" in out
    assert "E  tokens=12  cached=0   to compute=12  blocks=[11, 4, 6]" in out
    assert out.count("reuse drops cached hash") == 2
