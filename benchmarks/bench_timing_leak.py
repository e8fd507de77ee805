"""The prefix cache's timing side channel, measured against a live ``kvpool serve``.

A victim tenant sends a secret prompt. An attacker tenant then sends either
the same prompt (a positive trial) or a different prompt of exactly the same
length (a negative trial) and measures the time to its first streamed token.
If the attacker's request can hit the victim's cached blocks, positives are
answered sooner: the attacker learns what the victim sent (CVE-2025-46570).

The attacker's ability to tell the two apart is the area under the ROC curve
of "a faster first token means positive", over many trials: 0.5 is a coin
toss, 1.0 is certainty. It is measured twice, on two servers started here:

* with tenant isolation (the default: cache salts derived per tenant), and
* with ``--no-tenant-isolation`` (one prefix cache for everyone).

Prompts are random token IDs (so every trial's secret is new to the cache and
both prompts of a trial have the same length), a few hundred tokens long so
that a cached prefill is measurably shorter than a computed one on a CPU. The
attacker also reads ``usage.prompt_tokens_details.cached_tokens`` from its
streamed usage, the other channel the isolation must close.

    python benchmarks/bench_timing_leak.py --trials 200 --plot docs/security_roc.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"
KEYS = {"key-victim": "victim", "key-attacker": "attacker"}
_TOKEN_RANGE = (1000, 40000)  # ordinary vocabulary tokens of SmolLM2 (49152 in all)


# -- a kvpool serve process -------------------------------------------------------------------


#: The line ``kvpool serve`` logs once it listens, with the port it bound.
_LISTENING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)/v1")


@dataclass
class ServeProcess:
    """``kvpool serve`` started as a subprocess on port 0 (the OS picks a free port as it binds, so no other
    process can take it first); the port is read from its start-up line, and its output kept in a file."""

    args: Sequence[str]
    threads: int | None = None  # torch threads of the server (OMP_NUM_THREADS); None: torch's default
    port: int = 0  # known once started
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> ServeProcess:
        import httpx

        fd, name = tempfile.mkstemp(prefix="kvpool-serve-", suffix=".log")
        self.log_path = Path(name)
        command = [sys.executable, "-c", "from kvpool.cli import main; main()", "serve", "--host", "127.0.0.1"]
        command += ["--port", "0"]
        env = dict(os.environ)
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen([*command, *self.args], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvpool serve exited with {self.process.returncode}:\n{self.log()}")
            if not self.port and (listening := _LISTENING.search(self.log())) is not None:
                self.port = int(listening.group(1))
            try:
                if self.port and httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvpool serve did not answer within {timeout:.0f} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return "" if self.log_path is None else self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def serving(args: Sequence[str], threads: int | None = None) -> Iterator[ServeProcess]:
    server = ServeProcess(args, threads).start()
    try:
        yield server
    finally:
        server.stop()
        if server.log_path is not None:
            server.log_path.unlink(missing_ok=True)


# -- the attack ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Trial:
    positive: bool  # the attacker sent the victim's prompt
    ttft: float  # seconds to the attacker's first streamed token
    cached_tokens: int  # what the attacker's usage said


def _first_token(client: Any, prompt: list[int]) -> tuple[float, int]:
    """Time to the first streamed token and the cached tokens reported, for one attacker request."""
    start = time.perf_counter()
    ttft = None
    cached = 0
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    assert ttft is not None, "the stream carried no token"
    return ttft, cached


def run_trials(url: str, trials: int, prompt_tokens: int, seed: int, progress: bool = True) -> list[Trial]:
    import openai

    rng = random.Random(seed)
    victim = openai.OpenAI(base_url=f"{url}/v1", api_key="key-victim", max_retries=0, timeout=120)
    attacker = openai.OpenAI(base_url=f"{url}/v1", api_key="key-attacker", max_retries=0, timeout=120)

    def prompt() -> list[int]:
        return [rng.randrange(*_TOKEN_RANGE) for _ in range(prompt_tokens)]

    for _ in range(3):  # warm-up: first requests pay for lazy set-up
        _first_token(attacker, prompt())
    # Trials come in pairs, one positive and one negative in a random order: a server whose speed
    # drifts (other load on the machine) then slows both kinds alike instead of whichever came first.
    labels = []
    for _ in range((trials + 1) // 2):
        pair = [True, False]
        rng.shuffle(pair)
        labels += pair
    labels = labels[:trials]
    results = []
    for i, positive in enumerate(labels):
        secret = prompt()
        victim.completions.create(model=MODEL, prompt=secret, max_tokens=1, temperature=0)
        ttft, cached = _first_token(attacker, secret if positive else prompt())
        results.append(Trial(positive, ttft, cached))
        if progress and (i + 1) % max(1, trials // 10) == 0:
            print(f"  {i + 1}/{trials} trials", file=sys.stderr, flush=True)
    return results


# -- ROC -------------------------------------------------------------------------------------------


def roc_auc(trials: Sequence[Trial]) -> float:
    """P(a positive trial's first token is faster than a negative one's); ties count a half."""
    pos = [t.ttft for t in trials if t.positive]
    neg = [t.ttft for t in trials if not t.positive]
    if not pos or not neg:
        raise ValueError("the AUC needs positive and negative trials")
    wins = sum(1.0 if p < n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def roc_curve(trials: Sequence[Trial]) -> tuple[list[float], list[float]]:
    """False and true positive rates as the threshold "TTFT below t means positive" sweeps up."""
    ordered = sorted(trials, key=lambda t: t.ttft)
    num_pos = sum(t.positive for t in trials)
    num_neg = len(trials) - num_pos
    fpr, tpr = [0.0], [0.0]
    tp = fp = 0
    for t in ordered:
        if t.positive:
            tp += 1
        else:
            fp += 1
        fpr.append(fp / num_neg)
        tpr.append(tp / num_pos)
    return fpr, tpr


def summary(trials: Sequence[Trial]) -> dict[str, float]:
    def median(values: list[float]) -> float:
        values = sorted(values)
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    pos = [t for t in trials if t.positive]
    neg = [t for t in trials if not t.positive]
    return {
        "trials": len(trials),
        "auc": roc_auc(trials),
        "ttft_ms_median_same_prompt": 1000 * median([t.ttft for t in pos]),
        "ttft_ms_median_other_prompt": 1000 * median([t.ttft for t in neg]),
        "cached_tokens_mean_same_prompt": sum(t.cached_tokens for t in pos) / len(pos),
        "cached_tokens_mean_other_prompt": sum(t.cached_tokens for t in neg) / len(neg),
    }


def plot(results: dict[str, list[Trial]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 4.6))
    for name, trials in results.items():
        fpr, tpr = roc_curve(trials)
        ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc(trials):.2f})", drawstyle="steps-post")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="chance")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title("Attacker guessing a victim's prompt from TTFT")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------


def measure(
    trials: int,
    prompt_tokens: int,
    seed: int,
    extra_args: Sequence[str] = (),
    threads: int | None = 1,
    progress: bool = True,
) -> dict[str, list[Trial]]:
    """Both modes, one server each; trials per mode."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        base = ["--api-key-file", str(keys), "--max-model-len", str(max(1024, 2 * prompt_tokens)), *extra_args]
        for name, flags in (("tenant salts", []), ("no tenant isolation", ["--no-tenant-isolation"])):
            if progress:
                print(f"{name}: starting kvpool serve", file=sys.stderr, flush=True)
            with serving([*base, *flags], threads) as server:
                results[name] = run_trials(server.url, trials, prompt_tokens, seed, progress)
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200, help="trials per mode (half positive)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (1: steadiest when shared)")
    parser.add_argument("--plot", type=Path, default=None, help="write the ROC plot here (needs matplotlib)")
    parser.add_argument("--json", type=Path, default=None, help="write the per-trial figures here")
    args = parser.parse_args(argv)
    results = measure(
        args.trials, args.prompt_tokens, args.seed, ["--kv-cache-memory", args.kv_cache_memory], args.threads
    )
    figures = {name: summary(trials) for name, trials in results.items()}
    print(f"{'mode':<22} {'AUC':>5} {'TTFT same':>10} {'TTFT other':>11} {'cached same':>12} {'cached other':>13}")
    for name, f in figures.items():
        print(
            f"{name:<22} {f['auc']:5.2f} {f['ttft_ms_median_same_prompt']:8.1f}ms "
            f"{f['ttft_ms_median_other_prompt']:9.1f}ms {f['cached_tokens_mean_same_prompt']:12.1f} "
            f"{f['cached_tokens_mean_other_prompt']:13.1f}"
        )
    if args.plot is not None:
        plot(results, args.plot)
        print(f"ROC plot: {args.plot}")
    if args.json is not None:
        raw = {name: [[t.positive, t.ttft, t.cached_tokens] for t in trials] for name, trials in results.items()}
        args.json.write_text(json.dumps({"summary": figures, "trials": raw}, indent=1))
    return figures


if __name__ == "__main__":
    main()
