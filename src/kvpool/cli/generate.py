"""``kvpool generate`` and ``kvpool chat``: run a model on kvpool's engine from the shell.

Both start the engine the way a server does and log it (model, dtype, device,
KV blocks, the capacity line) on stderr, stream the generated text to stdout
as it is produced, and log one line of figures per request. Bad input is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from kvpool.cli.params import fail, require_extra
from kvpool.errors import KVPoolError
from kvpool.hashing import HashAlgo

__all__ = ["chat", "generate"]

_DEFAULT_MODEL = "smollm2-135m"  # kvpool.engine.model_store.DEFAULT_MODEL (that module loads torch)


#: The flags that are :class:`kvpool.engine.startup.EngineOptions` fields, under the same names.
_ENGINE_FLAGS = ("model", "block_size", "max_model_len", "kv_cache_memory", "device", "hash_algo")


def _log(line: str) -> None:
    click.echo(f"INFO {time.strftime('%H:%M:%S')} {line}", err=True)


def _engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options ``generate`` and ``chat`` share: model, engine and sampling."""
    options = [
        click.option(
            "--model", "model", metavar="NAME_OR_PATH", default=_DEFAULT_MODEL, show_default=True,
            help="A known model name or a local Hugging Face model folder.",
        ),
        click.option("--max-tokens", type=int, default=64, show_default=True, help="Most tokens to generate per reply."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]."),
        click.option("--top-k", type=int, default=None, help="Sample among the k most likely tokens."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
        click.option(
            "--kv-cache-memory", metavar="SIZE", default="512MiB", show_default=True,
            help="KV cache size (e.g. 512MiB, 2GB), or 'auto' to measure the memory left.",
        ),
        click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block."),
        click.option("--max-model-len", type=int, default=None, help="Tokens per request [default: the model's context]."),
        click.option("--cache-salt", default=None, help="Requests with different salts never share cached blocks."),
        click.option("--device", default=None, help="cpu or cuda [default: cuda when available]."),
        click.option(
            "--hash", "hash_algo", type=click.Choice([a.value for a in HashAlgo]), default=HashAlgo.SHA256.value,
            show_default=True, help="Block hash: kvpool's chain, or vLLM's sha256 / sha256_cbor (hashes identical to vLLM's).",
        ),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


def _setup(command: str, kw: dict[str, Any]) -> tuple[Any, Any]:
    """Build the sampling parameters (checked first) and start the engine."""
    require_extra(command, "engine", "torch", "transformers")
    import transformers

    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.engine.sampling import SamplingParams

    sampling: dict[str, Any] = {"max_tokens": kw["max_tokens"], "temperature": kw["temperature"]}
    for name in ("top_p", "top_k", "seed"):
        if kw[name] is not None:
            sampling[name] = kw[name]
    memory = kw["kv_cache_memory"]
    params = SamplingParams(**sampling)
    hf_logging: Any = transformers.utils.logging  # its functions carry no annotations
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    options = {name: kw[name] for name in _ENGINE_FLAGS}  # the flags are EngineOptions fields, by name
    options["kv_cache_memory"] = None if memory.strip().lower() == "auto" else memory
    engine = LLMEngine(**options, log=_log)
    _log(f"ready in {engine.setup.startup_seconds:.1f} s")
    return engine, params


def _stream(engine: Any, request_id: str) -> Any:
    """Print a request's text as it is produced; return its output."""
    from kvpool.engine.outputs import request_log_line

    output = None
    while output is None:
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            if delta.text:
                click.echo(delta.text, nl=False)
                sys.stdout.flush()
            if delta.output is not None:
                output = delta.output
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
@_guard("generate")
def generate(prompt: str, repeat: int, raw: bool, **kw: Any) -> None:
    """Generate a reply to PROMPT and stream it.

    With an instruct model the prompt goes through the model's chat template
    unless --raw is given. Repeats show the prefix cache at work: the second
    request finds the first one's blocks.
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
        _stream(engine, rid)


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
