"""The ``kvpool`` command line.

click is a dependency of kvpool, but only this package imports it: the library
itself needs the standard library alone. Each subcommand lives in its own
module and imports its heavy dependencies (torch, numpy, matplotlib) only when
it runs; a command whose extra is missing says which one to install.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool`` console script."""
    try:
        import click  # noqa: F401
    except ImportError:
        print("kvpool: error: the command line needs click: pip install 'click>=8.1'", file=sys.stderr)
        return 1
    from kvpool.cli.commands import cli

    return cli.main(args=argv, prog_name="kvpool", standalone_mode=True)
