"""What every command shares: numeric option types, and the two ways a command refuses.

* Option types: a bad number (negative, zero where a count is meant, nan, an
  infinity) is refused by click before the command runs, with exit status 2
  and a message naming the option and the value.
* :func:`fail`: one line on stderr, ``kvpool <command>: error: <message>``,
  then exit status 2 for bad input (:data:`BAD_INPUT`) or 1 when the machine
  lacks something (:data:`ENVIRONMENT`).
* :func:`require_extra`: a command that needs an optional dependency says
  which extra to install instead of failing on the import.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec

import click

from kvpool.checks import THREADS_AUTO as AUTO
from kvpool.errors import ExternalDataError, KVPoolError

P = ParamSpec("P")

__all__ = [
    "BAD_INPUT",
    "ENVIRONMENT",
    "NON_NEGATIVE_FLOAT",
    "NON_NEGATIVE_INT",
    "POSITIVE_INT",
    "TOKEN_COUNT",
    "FiniteFloatRange",
    "TokenCountType",
    "fail",
    "require_extra",
]

#: Exit status for bad input (click's own usage errors exit 2 as well).
BAD_INPUT = 2
#: Exit status when the environment is missing something (an extra, a readable file system).
ENVIRONMENT = 1


class FiniteFloatRange(click.FloatRange):
    """A :class:`click.FloatRange` that also refuses nan and the infinities (the range alone lets them through)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return number


#: ``--threads torch``: leave torch's own thread count (the engine's ``threads=None``).
TORCH_THREADS = "torch"


class ThreadsType(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2; >= 8.1 is allowed
    """``auto``, a thread count >= 1, or ``torch`` (None: torch's own setting), the engine's ``threads`` option."""

    name = "auto|N|torch"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or isinstance(value, int) or value == AUTO:
            return value
        if value == TORCH_THREADS:
            return None
        try:
            count = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither 'auto', 'torch' nor a thread count", param, ctx)
        if count < 1:
            self.fail(f"{value!r} threads: give at least 1, 'auto' or 'torch'", param, ctx)
        return count


class TokenCountType(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2; >= 8.1 is allowed
    """A token count as vLLM writes one: 4096, 4k, 4K (:func:`kvpool.checks.parse_token_count`)."""

    name = "N|Nk|NK"

    def __init__(self, minimum: int = 1) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from kvpool.checks import parse_token_count

        try:
            return parse_token_count(value, field="the count", minimum=self.minimum)
        except KVPoolError as exc:
            self.fail(str(exc), param, ctx)


THREADS = ThreadsType()
TOKEN_COUNT = TokenCountType()
POSITIVE_INT = click.IntRange(min=1)
NON_NEGATIVE_INT = click.IntRange(min=0)
NON_NEGATIVE_FLOAT = FiniteFloatRange(min=0)


def fail(command: str, message: str, status: int = BAD_INPUT) -> NoReturn:
    """Print ``kvpool <command>: error: <message>`` on stderr and exit with ``status``."""
    click.echo(f"kvpool {command}: error: {message}", err=True)
    sys.exit(status)


def reports_errors(command: str) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """Wrap a command's body: a ``KVPoolError`` or ``ExternalDataError`` it raises is one line naming it (status 2)."""

    def wrap(body: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(body)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            try:
                body(*args, **kwargs)
            except (KVPoolError, ExternalDataError) as exc:  # bad input, from the flags or from a file
                fail(command, str(exc))

        return run

    return wrap


def require_extra(command: str, extra: str, *modules: str) -> None:
    """Import ``modules``; when one is missing, fail naming the extra that provides it (exit status 1)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            fail(
                command,
                f"this needs {module}, which comes with kvpool's '{extra}' extra: pip install 'kvpool[{extra}]'",
                ENVIRONMENT,
            )
