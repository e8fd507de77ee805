"""The ``kvpool`` command group: one subcommand per module."""

from __future__ import annotations

from typing import Any

import click

from kvpool.build_info import build
from kvpool.cli.params import BAD_INPUT, ENVIRONMENT


class _Commands(click.Group):
    """The group, with the last line of defence: an error that escapes a command is one line, never a traceback.

    Commands check their input and report it themselves; this only catches
    what they missed: a ``ValueError`` (``KVPoolError`` included) exits with
    status 2, an ``OSError`` (the machine, not the input) with status 1.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            # the reader went away (``kvpool simulate ... | head``): nothing left to say to it
            ctx.exit(0)
        except ValueError as exc:
            click.echo(f"kvpool: error: {exc}", err=True)
            ctx.exit(BAD_INPUT)
        except OSError as exc:
            click.echo(f"kvpool: error: {exc}", err=True)
            ctx.exit(ENVIRONMENT)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvpool", message=f"%(prog)s, version %(version)s ({build()} build)")
def cli() -> None:
    """kvpool: a paged KV cache manager for LLM inference."""


# Subcommands register themselves below, one import per module.
from kvpool.cli.plan import plan  # noqa: E402

cli.add_command(plan)
from kvpool.cli.simulate import simulate  # noqa: E402

cli.add_command(simulate)
from kvpool.cli.generate import chat, generate  # noqa: E402

cli.add_command(generate)
cli.add_command(chat)
from kvpool.cli.serve import serve  # noqa: E402

cli.add_command(serve)
from kvpool.cli.route import route  # noqa: E402

cli.add_command(route)
from kvpool.cli.calibrate import calibrate  # noqa: E402

cli.add_command(calibrate)
