"""Every exception class kvpool defines sits under one documented root, and errors.py draws the real tree.

The roots say who is at fault (see :mod:`kvpool.errors`): the caller, data
from outside, the service, one request in the engine, or kvpool itself. The
walk imports every module of the package; a module whose optional extra is
not installed is skipped with the missing module named.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import kvpool
from kvpool import errors
from kvpool.errors import ExternalDataError, InvariantViolation, KVPoolError, RequestFailed, ServiceError

ROOTS = (KVPoolError, ExternalDataError, ServiceError, RequestFailed, InvariantViolation)
PACKAGE = Path(kvpool.__file__).parent


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it is the command line, not a definition
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = module_names()


def import_or_skip(name: str) -> ModuleType:
    """The module, or a skip naming the missing third-party module (an optional extra not installed)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == "kvpool" or missing.startswith("kvpool."):
            raise  # a module of the package itself is missing: a real failure
        pytest.skip(f"{name} needs {missing!r}, an optional extra not installed here")


def defined_exceptions(module: ModuleType) -> list[type[BaseException]]:
    return [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
    ]


def documented_tree() -> dict[str, str | None]:
    """Class name -> the name drawn as its parent in errors.py's tree (None for a built-in at the top)."""
    doc = errors.__doc__ or ""
    block = doc.split("The tree", 1)[1].split("::\n", 1)[1]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        match = re.search(r"[A-Za-z_]\w*", line)
        assert match is not None, f"a tree line without a class name: {line!r}"
        column, name = match.start(), match.group()
        while stack and stack[-1][0] >= column:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((column, name))
    return parents


@pytest.mark.parametrize("name", MODULES)
def test_each_exception_class_sits_under_exactly_one_root(name):
    module = import_or_skip(name)
    for cls in defined_exceptions(module):
        roots = [root for root in ROOTS if issubclass(cls, root)]
        assert len(roots) == 1, f"{cls.__module__}.{cls.__qualname__} sits under {roots}, not one of {ROOTS}"


def test_the_roots_are_apart_and_keep_their_builtin_bases():
    for i, a in enumerate(ROOTS):
        for b in ROOTS[i + 1 :]:
            assert not issubclass(a, b) and not issubclass(b, a), (a, b)
    # bad input of either kind is still a ValueError; only misuse is a KVPoolError
    assert issubclass(KVPoolError, ValueError) and issubclass(ExternalDataError, ValueError)
    assert not issubclass(ExternalDataError, KVPoolError)
    assert issubclass(ServiceError, RuntimeError) and issubclass(RequestFailed, RuntimeError)
    assert issubclass(InvariantViolation, AssertionError)


def test_the_docstring_draws_every_exception_class_under_its_real_base():
    drawn = documented_tree()
    found: dict[str, type[BaseException]] = {}
    skipped: list[str] = []
    for name in MODULES:
        try:
            module = import_or_skip(name)
        except pytest.skip.Exception:
            skipped.append(name)
            continue
        for cls in defined_exceptions(module):
            assert cls.__name__ not in found or found[cls.__name__] is cls, (
                f"two exception classes named {cls.__name__}"
            )
            found[cls.__name__] = cls
    builtins = {name for name, parent in drawn.items() if parent is None}
    assert builtins <= {"ValueError", "RuntimeError", "AssertionError"}, builtins
    missing = sorted(set(found) - set(drawn))
    assert not missing, f"exception classes missing from errors.py's tree: {missing}"
    for name, parent in drawn.items():
        if parent is None:
            continue
        cls = found.get(name)
        if cls is None:
            continue  # defined in a module skipped above (its extra is absent), or drawn but gone: checked below
        assert cls.__bases__[0].__name__ == parent, f"{name} is drawn under {parent}, but its base is {cls.__bases__}"
    gone = sorted(set(drawn) - builtins - set(found))
    assert not gone or skipped, f"errors.py's tree draws classes the package does not define: {gone}"


def test_moved_classes_stay_importable_where_they_were():
    from kvpool.kv_events import EventStreamError
    from kvpool.openai_http.protocol import APIError as ProtocolAPIError
    from kvpool.serve import APIError, QueueFull
    from kvpool.serve.engine_loop import EngineStopped
    from kvpool.sim.traces import TraceError
    from kvpool.tiers import CorruptEntry

    assert ProtocolAPIError is APIError
    for cls in (CorruptEntry, EventStreamError, TraceError):
        assert issubclass(cls, ExternalDataError) and issubclass(cls, ValueError) and not issubclass(cls, KVPoolError)
    for cls in (QueueFull, EngineStopped, APIError):
        assert issubclass(cls, ServiceError)
