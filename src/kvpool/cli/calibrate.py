"""``kvpool calibrate URL``: fit a cost profile from a short run against a live OpenAI-compatible server.

The flags map onto :class:`kvpool.calibration.CalibrationPlan` and :func:`kvpool.calibration.calibrate`,
where the rules live. Progress goes to stderr a line at a time, then the fit's error (each measurement
against its prediction, and the median and max); the profile's JSON goes to ``--output`` or stdout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvpool.cli.params import ENVIRONMENT, POSITIVE_INT, FiniteFloatRange, fail, reports_errors, require_extra
from kvpool.errors import ServiceError

__all__ = ["calibrate"]


class CountListType(click.ParamType):  # type: ignore[type-arg]  # generic only from click 8.2; >= 8.1 is allowed
    """``16,64,256``: integers separated by commas (the plan checks their range and order)."""

    name = "N,N,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)


COUNTS = CountListType()


def _progress(line: str) -> None:
    """One line on stderr, flushed, so a pipe or a log file sees it as it happens."""
    click.echo(f"calibrate {time.strftime('%H:%M:%S')} {line}", err=True)
    sys.stderr.flush()


@click.command("calibrate")
@click.argument("url")
@click.option("--model", default=None, help="The model to ask for; default: the one the server lists.")
@click.option("--name", default=None, help="The profile's name; default: 'fitted-' and the model's last path part.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the profile's JSON here (a file kvpool serve --emulate and kvpool simulate read); default: stdout.",
)
@click.option(
    "--kv-bytes-per-token",
    type=POSITIVE_INT,
    required=True,
    help="One token's KV bytes on the server (2 x layers x KV heads x head dim x dtype bytes; SmolLM2-135M in "
    "bfloat16: 23040). HTTP cannot tell it; the profile needs it to size an emulated pool.",
)
@click.option(
    "--prompt-tokens",
    type=COUNTS,
    default="16,64,256,1024",
    show_default=True,
    help="Prompt lengths timed alone (TTFT): the profile's prefill points. Keep them within the server's step "
    "token budget.",
)
@click.option("--repeats", type=POSITIVE_INT, default=3, show_default=True, help="Requests per prompt length.")
@click.option(
    "--batch-sizes",
    type=COUNTS,
    default="1,2,4,8",
    show_default=True,
    help="Sequences decoding at once, one group per size and context length.",
)
@click.option(
    "--context-tokens",
    type=COUNTS,
    default="32,768",
    show_default=True,
    help="Prompt lengths of the decode groups (the context their steps read).",
)
@click.option("--decode-tokens", type=POSITIVE_INT, default=24, show_default=True, help="Tokens each group decodes.")
@click.option("--api-key", envvar="VLLM_API_KEY", default=None, help="Bearer key for the server ($VLLM_API_KEY).")
@click.option(
    "--server-command",
    default=None,
    help="How the server was started, recorded in the profile's source beside the URL, time and machine.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=FiniteFloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds one request may take.",
)
@reports_errors("calibrate")
def calibrate(
    url: str,
    model: str | None,
    name: str | None,
    output: str | None,
    kv_bytes_per_token: int,
    prompt_tokens: tuple[int, ...],
    repeats: int,
    batch_sizes: tuple[int, ...],
    context_tokens: tuple[int, ...],
    decode_tokens: int,
    api_key: str | None,
    server_command: str | None,
    timeout_s: float,
) -> None:
    """Fit a cost profile to the OpenAI-compatible server at URL (http://127.0.0.1:8000) from a short run.

    Prompts of several lengths sent alone time prefill (TTFT); groups decoding together at several batch
    sizes and context lengths time the decode step (inter-token gaps). Prints each measurement against the
    fitted profile's prediction, then the median and max relative error. Unique prompts: nothing is cached.
    """
    require_extra("calibrate", "route", "httpx")
    from kvpool.calibration import CalibrationPlan
    from kvpool.calibration import calibrate as run_calibration

    plan = CalibrationPlan(
        prompt_tokens=prompt_tokens,
        repeats=repeats,
        batch_sizes=batch_sizes,
        context_tokens=context_tokens,
        decode_tokens=decode_tokens,
    )
    out_path = Path(output) if output is not None else None
    if out_path is not None and not out_path.parent.is_dir():
        fail("calibrate", f"--output {output!r}: the folder {str(out_path.parent)!r} does not exist")
    try:
        _, fit = run_calibration(
            url,
            plan,
            name=name,
            kv_bytes_per_token=kv_bytes_per_token,
            model=model,
            api_key=api_key,
            server_command=server_command,
            timeout_s=timeout_s,
            progress=_progress,
        )
    except ServiceError as exc:
        fail("calibrate", str(exc), ENVIRONMENT)
    profile = fit.profile
    for line in fit.report_lines():
        click.echo(line, err=True)
    text = json.dumps(profile.to_dict(), indent=2) + "\n"
    if out_path is None:
        click.echo(text, nl=False)
    else:
        out_path.write_text(text, encoding="utf-8")
        click.echo(f"wrote profile {profile.name!r} to {out_path}", err=True)
