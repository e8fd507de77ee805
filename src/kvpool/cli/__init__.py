"""The ``kvpool`` command line.

Command-line tools need the ``cli`` extra (click); the library itself does not.
Each subcommand lives in its own module and imports its heavy dependencies
(torch, numpy) only when it runs.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool`` console script."""
    try:
        import click  # noqa: F401
    except ImportError:
        print("kvpool's command line needs click: pip install 'kvpool[cli]'", file=sys.stderr)
        return 2
    from kvpool.cli.app import cli

    return cli.main(args=argv, prog_name="kvpool", standalone_mode=True)
