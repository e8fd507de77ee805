"""Record vLLM's KV cache manager decisions as fixtures that kvpool replays without vLLM.

Drives vLLM's ``KVCacheManager`` through every scenario of
``tests/parity_traffic.py`` (seeded traffic: admissions with prefix hits and
cache salts, chunked prefill, decodes with lookahead slots, preemption and
re-admission, frees, ``reset_prefix_cache`` refused and accepted, tight pools
that evict; one full-attention group and hybrid full / sliding-window /
chunked-local groups with equal and multiple block sizes) and writes one
gzip'd JSON-lines file per scenario family to ``tests/fixtures/vllm/``: a
metadata line (vLLM version, the scenario list), then one line per scenario
holding its parameters and every operation with vLLM's decision.
``tests/test_vllm_recorded.py`` replays them against kvpool on every test
run.

Runs only where vLLM is installed beside kvpool, in a separate virtual
environment (vLLM is never a kvpool dependency). From the repository root::

    python3 -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install torch==2.13.0          # the CPU wheel
    /work/venv-vllm/bin/pip install --no-deps vllm==0.33.0
    /work/venv-vllm/bin/pip install --no-deps \\
        aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \\
        annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 \\
        cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 \\
        cloudpickle==3.1.3 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 \\
        httpx2==2.16.2 huggingface-hub==2.4.0 idna==3.20 llguidance==1.9.1 msgspec==0.23.0 \\
        multidict==7.2.1 numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8 \\
        opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 \\
        prometheus-client==0.26.0 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 \\
        pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyyaml==6.0.4 pyzmq==27.3.0 \\
        regex==2026.11.19 requests==2.34.2 safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 \\
        tokenizers==0.23.3 tqdm==4.70.1 transformers==5.24.0 truststore==0.10.5 \\
        typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1
    /work/venv-vllm/bin/pip install -e ".[test,fast]"
    /work/venv-vllm/bin/python benchmarks/record_vllm_decisions.py
    /work/venv-vllm/bin/python -m pytest -q tests/test_vllm_parity.py tests/test_vllm_recorded.py

``--only FAMILY`` records one family; ``--out DIR`` writes elsewhere.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vllm_reference import VLLMReference  # noqa: E402

from tests.parity_traffic import MAX_MODEL_LEN, family_of, generate, recorded_scenarios  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "vllm"


def record(family: str, scenarios, out: Path) -> tuple[int, Counter]:
    """Write one family's fixture; its size in bytes and the operations it holds by kind."""
    import vllm

    counts: Counter = Counter()
    lines = [
        json.dumps(
            {
                "meta": {
                    "vllm_version": vllm.__version__,
                    "family": family,
                    "max_model_len": MAX_MODEL_LEN,
                    "hash": "sha256",
                    "recorded_by": "benchmarks/record_vllm_decisions.py",
                    "traffic": "tests/parity_traffic.py",
                    "scenarios": [s.name for s in scenarios],
                }
            },
            separators=(",", ":"),
        )
    ]
    for sc in scenarios:
        ops = list(generate(sc, VLLMReference(sc.num_blocks, sc.groups, MAX_MODEL_LEN)))
        counts.update(op["op"] for op in ops)
        counts.update(f"{op['op']}:refused" for op in ops if op.get("new", 0) is None)
        counts.update(f"reset:{op['ok']}" for op in ops if op["op"] == "reset")
        counts.update("admit:hit" for op in ops if op.get("hit"))
        lines.append(json.dumps({"scenario": sc.to_dict(), "ops": ops}, separators=(",", ":")))
    path = out / f"{family}.jsonl.gz"
    data = ("\n".join(lines) + "\n").encode()
    # mtime=0: the same decisions give byte-identical files.
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
        f.write(data)
    return path.stat().st_size, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="record this family only")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    families: dict[str, list] = {}
    for sc in recorded_scenarios():
        families.setdefault(family_of(sc), []).append(sc)
    total = 0
    for family, scenarios in families.items():
        if args.only and family != args.only:
            continue
        start = time.perf_counter()
        size, counts = record(family, scenarios, args.out)
        total += size
        summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(
            f"{family}: {len(scenarios)} scenarios, {size / 1024:.0f} KiB, {time.perf_counter() - start:.1f} s; {summary}"
        )
    print(f"total {total / 1024:.0f} KiB in {args.out}")


if __name__ == "__main__":
    main()
