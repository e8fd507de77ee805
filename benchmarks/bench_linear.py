"""The weight products of one step, on each linear kernel (kvpool.engine.linear), side by side.

SmolLM2-135M's shapes: 30 layers of fused q/k/v (960 x 576), output (576 x 576), fused
gate/up (3072 x 576) and down (576 x 1536), and the tied LM head (49152 x 576), all
fp32 and all held at once (540 MB: the weights come from memory, as in a real step,
not from a cache that held one layer). Each figure is the median of ``--repeats``
passes over every layer (or the head alone), for each number of rows (tokens in the
step: 1 is a one-request decode step, 32 a 32-request one, 512 a prefill chunk).

    python benchmarks/bench_linear.py --threads 2 --rows 1,32,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpool.engine.linear import LinearKernel, linear_function, select_linear_kernel

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in)
HEAD_SHAPE = (49152, 576)


def _median_ms(fn, repeats: int) -> float:
    fn()  # the first pass touches every page once
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--rows", default="1,32,512", help="tokens in the step, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    layers = [[torch.randn(shape, generator=generator) * 0.02 for shape in LAYER_SHAPES] for _ in range(LAYERS)]
    head = torch.randn(HEAD_SHAPE, generator=generator) * 0.02
    kernels = [k for k in LinearKernel if k is LinearKernel.TORCH or select_linear_kernel("cpu", torch.float32) is k]
    print(f"torch {torch.__version__}; kernels {', '.join(k.value for k in kernels)}; default "
          f"{select_linear_kernel('cpu', torch.float32).value}", flush=True)  # fmt: skip
    print("| threads | rows | part | " + " | ".join(f"{k.value} ms" for k in kernels) + " | torch / each |")
    print("| --- | ---: | --- | " + " | ".join("---:" for _ in kernels) + " | ---: |")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {width: torch.randn(rows, width, generator=generator) for width in (576, 1536)}
            for part in ("layers", "head"):
                figures = []
                for kernel in kernels:
                    linear = linear_function(kernel)

                    def layer_pass(linear=linear, inputs=inputs) -> None:
                        for layer in layers:
                            for weight in layer:
                                linear(inputs[weight.shape[1]], weight, None)

                    def head_pass(linear=linear, inputs=inputs) -> None:
                        linear(inputs[576], head, None)

                    with torch.inference_mode():
                        figures.append(_median_ms(layer_pass if part == "layers" else head_pass, args.repeats))
                ratios = ", ".join(f"{figures[0] / f:.2f}x" for f in figures[1:]) or "-"
                cells = " | ".join(f"{f:.2f}" for f in figures)
                print(f"| {threads} | {rows} | {part} | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
