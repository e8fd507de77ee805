"""Which build runs: ``kvpool.BUILD``, ``kvpool --version`` and the compiled build's switch."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool.build_info import COMPILED_MODULES, build, compiled_modules
from kvpool.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _is_extension(name: str) -> bool:
    origin = importlib.import_module(name).__file__ or ""
    return origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_build_names_what_was_imported():
    loaded = [name for name in COMPILED_MODULES if _is_extension(name)]
    assert compiled_modules() == tuple(loaded)
    expected = "pure" if not loaded else "compiled" if len(loaded) == len(COMPILED_MODULES) else "mixed"
    assert kvpool.BUILD == build() == expected


def test_the_expected_build_runs():
    # CI sets this where it installed the compiled build, so a build that fell
    # back to pure Python (or half compiled) fails there instead of passing unnoticed.
    expected = os.environ.get("KVPOOL_EXPECT_BUILD")
    if expected is None:
        pytest.skip("KVPOOL_EXPECT_BUILD is not set")
    assert kvpool.BUILD == expected, f"{kvpool.BUILD} build imported from {kvpool.__file__}"


def test_every_compiled_module_has_its_source():
    for name in COMPILED_MODULES:
        assert (ROOT / "src" / Path(*name.split("."))).with_suffix(".py").is_file(), name


def test_version_says_which_build(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"({kvpool.BUILD} build)" in out and kvpool.__version__ in out


def test_a_bad_compile_switch_is_refused_by_value():
    env = {**os.environ, "KVPOOL_COMPILE": "yes"}
    done = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "KVPOOL_COMPILE must be 0 or 1 (or unset), got 'yes'" in done.stderr
