"""The optional compiled build of kvpool's core (everything else is in pyproject.toml).

``pip install .`` installs pure Python. With ``KVPOOL_COMPILE=1`` in the
environment, the bookkeeping core listed in ``kvpool.build_info.COMPILED_MODULES`` is also
compiled to C extension modules with mypyc, from the same typed sources; the
``.py`` files are installed beside them and every other module stays
interpreted. ``kvpool.BUILD`` says which build was imported.
"""

from __future__ import annotations

import glob
import os
import runpy
import shutil

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
#: The compiled modules, as ``kvpool.build_info`` lists them (read without importing kvpool).
COMPILED_MODULES: tuple[str, ...] = runpy.run_path(os.path.join(HERE, "src", "kvpool", "build_info.py"))[
    "COMPILED_MODULES"
]


def _compile_requested() -> bool:
    value = os.environ.get("KVPOOL_COMPILE", "").strip()
    if value not in ("", "0", "1"):
        raise SystemExit(f"KVPOOL_COMPILE must be 0 or 1 (or unset), got {value!r}")
    return value == "1"


def _extensions() -> list[object]:
    if not _compile_requested() or os.environ.get("KVPOOL_LISTING_BUILD_REQUIREMENTS") == "1":
        return []  # the build backend is only asking for requirements: mypy is not installed yet
    from mypyc.build import mypycify  # the build backend adds mypy to the build requirements

    # src/ holds no __init__.py, so src/kvpool/x.py compiles to the module kvpool.x
    paths = [os.path.join("src", *name.split(".")) + ".py" for name in COMPILED_MODULES]
    # The build environment holds mypy alone: optional libraries the core imports lazily
    # (cbor2, xxhash) are typed as Any there; CI's mypy checks them with the extras installed.
    options = ["--ignore-missing-imports"]
    return list(mypycify(options + paths, opt_level="3", target_dir=os.path.join("build", "compiled", "c")))


def _build_base() -> str:
    """Each build has its own build directory, so a pure build never installs a compiled build's leftovers.

    The compiled one starts without the extension modules of an earlier build (a
    module dropped from the list must not be installed from an old ``.so``).
    """
    if not _compile_requested():
        return os.path.join("build", "pure")
    base = os.path.join("build", "compiled")
    for stale in glob.glob(os.path.join(base, "lib*")):
        shutil.rmtree(stale)
    return base


setup(ext_modules=_extensions(), options={"build": {"build_base": _build_base()}})
