"""The ``kvpool`` command group: one subcommand per module."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvpool")
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
