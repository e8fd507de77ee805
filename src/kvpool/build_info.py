"""Which build of kvpool's core is running: pure Python, or compiled with mypyc.

The pure-Python modules are the reference. ``KVPOOL_COMPILE=1 pip install .``
also compiles the modules in :data:`COMPILED_MODULES` from the same sources
(``setup.py`` reads that tuple); Python then imports each one's C extension
instead of its ``.py`` file. Both builds make the same decisions; only their
speed differs. ``kvpool.BUILD`` (and ``kvpool --version``) names the build.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from typing import Final, Literal

__all__ = ["COMPILED_MODULES", "VERSION", "Build", "build", "compiled_modules"]

#: kvpool's version (``kvpool.__version__``, ``GET /version``).
VERSION: Final = "0.1.0"

#: The bookkeeping core, compiled by the compiled build. Every other module is
#: always interpreted (BENCHMARKS.md, "A compiled core", says why for each left out).
#: ``request`` and ``manager`` are the API boundary and stay interpreted: compiled,
#: their fields become native attributes that interpreted callers read and write
#: more slowly than slots, and mypyc 1.19 drops a property setter's exception, so a
#: read-only field could not raise ReadOnlyFieldError ("Round 3: a compiled request path").
COMPILED_MODULES: Final = (
    "kvpool.block",
    "kvpool.linked_blocks",
    "kvpool.free_queue",
    "kvpool.prefix_index",
    "kvpool.block_pool",
    "kvpool.hashing",
    "kvpool.groups.base",
    "kvpool.groups.full_attention",
    "kvpool.groups.sliding_window",
    "kvpool.groups.chunked_local",
    "kvpool.groups.cross_attention",
    "kvpool.groups.mamba",
    "kvpool.coordinator",
    "kvpool.events",
)

#: ``"pure"``: every module interpreted; ``"compiled"``: all of :data:`COMPILED_MODULES`
#: are C extensions; ``"mixed"``: some are (a partial or stale build).
Build = Literal["pure", "compiled", "mixed"]


def compiled_modules() -> tuple[str, ...]:
    """The modules of :data:`COMPILED_MODULES` that Python imports from a C extension here."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for name in COMPILED_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None and spec.origin.endswith(suffixes):
            found.append(name)
    return tuple(found)


def build() -> Build:
    """Which build this installation imports (see :data:`Build`)."""
    compiled = len(compiled_modules())
    if compiled == 0:
        return "pure"
    return "compiled" if compiled == len(COMPILED_MODULES) else "mixed"
