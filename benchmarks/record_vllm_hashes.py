"""Record vLLM's block hashes and KV event bytes as test fixtures (run with a Python that has vLLM).

    /work/venv-vllm/bin/python benchmarks/record_vllm_hashes.py [--out tests/fixtures]

Hashes come from vLLM's own request block hasher (``get_request_block_hasher``
on a ``vllm.v1.request.Request``, the prompt first, then output tokens
appended), for ``sha256`` and ``sha256_cbor``, several block sizes, cache
salts, LoRA adapters and multimodal items, with ``PYTHONHASHSEED`` unset and
set. Event batches are encoded with vLLM's ``KVEventBatch`` classes. The tests
compare kvpool against these files, so CI needs no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

# Each case: block size, prompt length, output tokens appended after it, salt, LoRA (name, path), media.
CASES: list[dict[str, Any]] = [
    {"block_size": 16, "prompt": 70, "output": 0},
    {"block_size": 16, "prompt": 64, "output": 37, "cache_salt": "tenant-a"},
    {"block_size": 4, "prompt": 23, "output": 9, "lora": ["sql-adapter", "/adapters/sql"]},
    {"block_size": 32, "prompt": 100, "output": 0, "cache_salt": "tenant-b", "lora": ["chat", "chat"]},
    {"block_size": 8, "prompt": 60, "output": 12, "mm": [["img-0f3a", 3, 10], ["img-77c1", 13, 20]]},
    {
        "block_size": 16,
        "prompt": 80,
        "output": 20,
        "cache_salt": "t",
        "lora": ["vision-lora", "/loras/vision"],
        "mm": [["audio-9", 0, 5], ["img-a", 20, 40], ["img-a", 64, 4]],
    },
    {"block_size": 1, "prompt": 9, "output": 3, "cache_salt": "s"},
    {"block_size": 64, "prompt": 63, "output": 0},
]
SEEDS: list[str | None] = [None, "0", "12345"]
ALGOS = ["sha256", "sha256_cbor"]


def tokens_for(case_index: int, count: int) -> list[int]:
    rng = random.Random(case_index)
    # Small, two-byte, four-byte and beyond-int32 IDs: every integer encoding.
    pool = [rng.randrange(0, 256), rng.randrange(256, 65536), rng.randrange(65536, 2**31), 2**31 + 7, 2**32 - 1]
    return [rng.choice(pool) if rng.random() < 0.1 else rng.randrange(0, 152_000) for _ in range(count)]


def record_hashes() -> dict[str, Any]:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    out: dict[str, Any] = {}
    for algo in ALGOS:
        fn = get_hash_fn_by_name(algo)
        cases = []
        for seed in SEEDS:
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            kv_cache_utils.init_none_hash(fn)
            for i, case in enumerate(CASES):
                # Fresh string objects, as a server parsing requests has (pickle back-references identical objects).
                case = json.loads(json.dumps(case))
                bs = case["block_size"]
                tokens = tokens_for(i, case["prompt"] + case["output"])
                lora = case.get("lora")
                mm = [
                    MultiModalFeatureSpec(
                        data=None,
                        modality="image",
                        identifier=ident,
                        mm_position=PlaceholderRange(offset=off, length=n),
                    )
                    for ident, off, n in case.get("mm", [])
                ]
                request = Request(
                    request_id=f"case-{i}",
                    prompt_token_ids=tokens[: case["prompt"]],
                    sampling_params=SamplingParams(max_tokens=max(1, case["output"])),
                    pooling_params=None,
                    mm_features=mm or None,
                    lora_request=LoRARequest(lora[0], i + 1, lora[1]) if lora else None,
                    cache_salt=case.get("cache_salt"),
                    block_hasher=kv_cache_utils.get_request_block_hasher(bs, fn),
                )
                for start in range(case["prompt"], len(tokens), 5):  # outputs arrive a few at a time
                    request.append_output_token_ids(tokens[start : start + 5])
                cases.append(
                    {
                        "seed_env": seed,
                        "block_size": bs,
                        "num_prompt_tokens": case["prompt"],
                        "token_ids": tokens,
                        "cache_salt": case.get("cache_salt"),
                        "lora_name": lora[0] if lora else None,
                        "lora_path": lora[1] if lora else None,
                        "mm_inputs": [{"identifier": a, "offset": b, "length": c} for a, b, c in case.get("mm", [])],
                        "none_hash": bytes(kv_cache_utils.NONE_HASH).hex(),
                        "block_hashes": [bytes(h).hex() for h in request.block_hashes],
                    }
                )
        out[algo] = {
            "vllm_version": version("vllm"),
            "python": sys.version.split()[0],
            "pickle_protocol": pickle.HIGHEST_PROTOCOL,
            "algorithm": algo,
            "cases": cases,
        }
        print(f"{algo}: {len(cases)} cases", file=sys.stderr)
    os.environ.pop("PYTHONHASHSEED", None)
    return out


# Sample batches, described in JSON (hashes in hex) and encoded by vLLM's classes.
H = [bytes([i]) * 32 for i in range(1, 8)]
BATCHES: list[dict[str, Any]] = [
    {
        "ts": 1796000000.25,
        "data_parallel_rank": 0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [H[0], H[1]],
                "parent_block_hash": None,
                "token_ids": list(range(100, 108)),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {"type": "BlockRemoved", "block_hashes": [H[2]], "medium": "GPU", "group_idx": 0},
        ],
    },
    {
        "ts": 1796000001.5,
        "data_parallel_rank": 0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [H[3], H[4]],
                "parent_block_hash": H[1],
                "token_ids": [7, 8, 9, 10, 11, 12, 13, 14],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": "sql-adapter",
                "extra_keys": [["sql-adapter", ["img-1", -2], "tenant-a"], ["sql-adapter"]],
                "group_idx": 1,
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 128,
            },
            {"type": "BlockRemoved", "block_hashes": [H[5]], "medium": "CPU", "group_idx": 1},
            {"type": "AllBlocksCleared"},
        ],
    },
    {
        "ts": 1796000002.0,
        "data_parallel_rank": 0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [H[6]],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [["m", ["audio", 0]]],
                "group_idx": 2,
                "kv_cache_spec_kind": "mamba",
            }
        ],
    },
    {"ts": 1796000003.0, "data_parallel_rank": 0, "events": []},
]


def _to_vllm(event: dict[str, Any]) -> Any:
    from vllm.distributed import kv_events as ke

    fields = {k: v for k, v in event.items() if k != "type"}
    if "extra_keys" in fields:
        fields["extra_keys"] = [
            None if keys is None else tuple(tuple(k) if isinstance(k, list) else k for k in keys)
            for keys in fields["extra_keys"]
        ]
    return getattr(ke, event["type"])(**fields)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def record_events() -> dict[str, Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    encoder = msgspec.msgpack.Encoder()
    batches = []
    for batch in BATCHES:
        vllm_batch = KVEventBatch(
            ts=batch["ts"],
            events=[_to_vllm(e) for e in batch["events"]],
            data_parallel_rank=batch["data_parallel_rank"],
        )
        payload = encoder.encode(vllm_batch)
        # vLLM's decoder reads back what it wrote, field for field.
        assert encoder.encode(msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)) == payload
        batches.append({"batch": _jsonable(batch), "payload_hex": payload.hex()})
    return {"vllm_version": version("vllm"), "msgspec_version": msgspec.__version__, "batches": batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures")
    args = parser.parse_args()
    hashes = record_hashes()
    (args.out / "vllm_hashes").mkdir(parents=True, exist_ok=True)
    for algo, data in hashes.items():
        path = args.out / "vllm_hashes" / f"{algo}.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    (args.out / "vllm_events").mkdir(parents=True, exist_ok=True)
    path = args.out / "vllm_events" / "batches.json"
    path.write_text(json.dumps(record_events(), indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
