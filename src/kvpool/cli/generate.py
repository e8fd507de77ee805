"""``kvpool generate`` and ``kvpool chat``: run a model on kvpool's engine from the shell.

Both start the engine the way a server does and log it (model, dtype, device,
KV blocks, the capacity line) on stderr, stream the generated text to stdout
as it is produced, and log one line of figures per request. Bad input is one
line on stderr and exit status 2.

``--kv-tier`` (repeatable, in lookup order) adds KV offload tiers below the
pool: ``cpu:4GiB``, ``disk:/var/cache/kvpool:50GiB``, ``redis://host:6379/0``
(see :mod:`kvpool.engine.kv_transfer`). ``generate --json`` prints one JSON
object per request instead of the text (:func:`request_json`).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from kvpool.cli import shared_flags
from kvpool.cli.params import fail, require_extra
from kvpool.cli.shared_flags import ENGINE_OPTIONS, apply_options
from kvpool.errors import KVPoolError

__all__ = ["chat", "generate"]

#: ``generate``'s ``--max-tokens`` when it is not given (``chat`` has none: a reply runs to EOS or the context).
GENERATE_MAX_TOKENS = 64

#: The sources ``--json`` always reports, in this order (the pool, then the tier kinds).
TIER_NAMES = ("gpu", "cpu", "disk", "redis")


def _log(line: str) -> None:
    click.echo(f"INFO {time.strftime('%H:%M:%S')} {line}", err=True)


def _engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options ``generate`` and ``chat`` share: the engine's (:mod:`.shared_flags`), sampling, the cache salt."""
    engine = ENGINE_OPTIONS
    options = [
        engine["model"],
        click.option(
            "--max-tokens", type=int, default=None,
            help=f"Most tokens to generate per reply [default: {GENERATE_MAX_TOKENS} for generate; chat replies run "
            "to their end (EOS) or the end of the context, as vLLM's chat does].",
        ),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]."),
        click.option("--top-k", type=int, default=None, help="Sample among the k most likely tokens."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
        *(engine[name] for name in ("kv_cache_memory", "block_size", "max_model_len", "dtype", "tensor_parallel_size")),
        click.option("--cache-salt", default=None, help="Requests with different salts never share cached blocks."),
        *(engine[name] for name in ("device", "threads", "linear_kernel", "hash_algo", "kv_tiers", "kv_tier_secret_file",
                                    "kv_tier_unauthenticated", "kv_tier_namespace", "kv_tier_write",
                                    "kv_tier_load_deadline", "kv_tier_always_load")),
    ]  # fmt: skip
    return apply_options(command, options)


def _setup(command: str, kw: dict[str, Any]) -> tuple[Any, Any]:
    """Build the sampling parameters (checked first) and start the engine."""
    require_extra(command, "engine", "torch", "transformers")
    import transformers

    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.engine.sampling import SamplingParams

    max_tokens = kw["max_tokens"]
    if max_tokens is None and command == "generate":
        max_tokens = GENERATE_MAX_TOKENS
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": kw["temperature"]}
    for name in ("top_p", "top_k", "seed"):
        if kw[name] is not None:
            sampling[name] = kw[name]
    params = SamplingParams(**sampling)
    hf_logging: Any = transformers.utils.logging  # its functions carry no annotations
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    engine = LLMEngine(**shared_flags.engine_options(kw), log=_log)
    _log(f"ready in {engine.setup.startup_seconds:.1f} s")
    return engine, params


def request_json(output: Any) -> dict[str, Any]:
    """One finished request as ``generate --json`` prints it."""
    by_tier = output.cached_tokens_by_tier
    return {
        "request_id": output.request_id,
        "text": output.text,
        "num_prompt_tokens": output.num_prompt_tokens,
        "num_cached_tokens": output.num_cached_tokens,
        "cached_tokens_by_tier": {name: by_tier.get(name, 0) for name in TIER_NAMES},
        "num_computed_tokens": output.num_computed_tokens,
        "num_output_tokens": output.num_output_tokens,
        "time_to_first_token": output.time_to_first_token,
        "finish_reason": output.finish_reason.value,
    }


def _stream(engine: Any, request_id: str, *, echo: bool = True) -> Any:
    """Print a request's text as it is produced (unless ``echo`` is off); return its output."""
    from kvpool.engine.outputs import request_log_line

    output = None
    while output is None:
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            if delta.text and echo:
                click.echo(delta.text, nl=False)
                sys.stdout.flush()
            if delta.output is not None:
                output = delta.output
    if echo:
        click.echo()
    _log(request_log_line(output))
    return output


def _guard(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn a kvpool error into one line on stderr and exit status 2."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except KVPoolError as exc:
                fail(command, str(exc))

        return run

    return wrap


@click.command("generate")
@click.argument("prompt")
@_engine_options
@click.option("--repeat", type=int, default=1, show_default=True, help="Send the prompt N times, one after another.")
@click.option("--raw", is_flag=True, help="Send the prompt as plain text, not through the chat template.")
@click.option(
    "--json", "as_json", is_flag=True,
    help="Print one JSON object per request (text, token counts, cached tokens by tier, time to first token).",
)  # fmt: skip
@_guard("generate")
def generate(prompt: str, repeat: int, raw: bool, as_json: bool, **kw: Any) -> None:
    """Generate a reply to PROMPT and stream it.

    With an instruct model the prompt goes through the model's chat template
    unless --raw is given. Repeats show the prefix cache at work: the second
    request finds the first one's blocks. With --json, each request is one
    line of JSON on stdout instead of its streamed text.
    """
    if repeat < 1:
        fail("generate", f"--repeat must be >= 1, got {repeat}")
    if not prompt:
        fail("generate", "the prompt is empty")
    engine, params = _setup("generate", kw)
    tokenizer = engine.tokenizer
    templated = not raw and tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    text = engine.render_chat([{"role": "user", "content": prompt}]) if templated else prompt
    if templated:
        _log("prompt written with the model's chat template (--raw sends it as is)")
    for _ in range(repeat):
        rid = engine.add_request(text, params, cache_salt=kw["cache_salt"], add_special_tokens=not templated)
        output = _stream(engine, rid, echo=not as_json)
        if as_json:
            click.echo(json.dumps(request_json(output)))
            sys.stdout.flush()
    if engine.kv_tiers is not None:
        engine.kv_tiers.close()


@click.command("chat")
@_engine_options
@click.option("--system", default=None, help="A system message that opens the conversation.")
@_guard("chat")
def chat(system: str | None, **kw: Any) -> None:
    """Chat on stdin: one line per turn; /exit or end of input quits.

    Every turn sends the whole conversation so far, so the earlier turns come
    from the prefix cache (see "cached" in each request's log line).
    """
    engine, params = _setup("chat", kw)
    conversation: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
    stdin = sys.stdin
    interactive = stdin.isatty()
    if interactive:
        _log("type a message and press Enter; /exit or Ctrl-D quits")
    while True:
        if interactive:
            click.echo(">>> ", nl=False)
        line = stdin.readline()
        if not line:
            break
        message = line.strip()
        if message == "/exit":
            break
        if not message:
            continue
        conversation.append({"role": "user", "content": message})
        text = engine.render_chat(conversation)
        rid = engine.add_request(text, params, cache_salt=kw["cache_salt"], add_special_tokens=False)
        output = _stream(engine, rid)
        conversation.append({"role": "assistant", "content": output.text})
    if engine.kv_tiers is not None:
        engine.kv_tiers.close()
