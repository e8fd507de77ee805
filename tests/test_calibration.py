"""kvpool calibrate: the fit recovers a known profile, and bad servers are named.

Two ways: measurements computed from a known :class:`CostProfile` (exact, and with seeded noise) fed to
the fit; and a small fake OpenAI server in this process (port 0) whose engine thread paces its steps by
the known profile, driven over HTTP by the real client (its steps take milliseconds; the tolerance is
wide for a loaded machine). Bad input: an unreachable URL, a server answering garbage, a stream of
garbage, each refused by ``kvpool calibrate`` with a message naming the URL.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from queue import Queue

import pytest
from click.testing import CliRunner

pytest.importorskip("httpx")

from kvpool.calibration import (  # noqa: E402
    CalibrationPlan,
    DecodeSample,
    PrefillSample,
    calibrate,
    fit_profile,
    measure,
)
from kvpool.cli.commands import cli  # noqa: E402
from kvpool.cost_model import CostProfile, load_profile  # noqa: E402
from kvpool.errors import ConfigError, ExternalDataError, ServiceError  # noqa: E402

KNOWN = CostProfile(
    name="known",
    source="the test's",
    step_overhead_s=0.008,
    prefill_s_per_token=((16, 1.2e-3), (64, 5e-4), (256, 2.5e-4)),
    decode_s_per_seq=0.004,
    s_per_context_token=2e-5,
    kv_bytes_per_token=1024,
)
PLAN = CalibrationPlan(
    prompt_tokens=(16, 64, 256), repeats=3, batch_sizes=(1, 2, 4), context_tokens=(16, 256), decode_tokens=8
)


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * want


def _synthetic(profile: CostProfile, noise: float, seed: int = 0) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """What PLAN measures on a server timed by ``profile``, each time off by up to ``noise`` (relative)."""
    rng = random.Random(seed)

    def jitter(seconds: float) -> float:
        return seconds * (1 + rng.uniform(-noise, noise))

    prefills = [
        PrefillSample(prompt_tokens=p, ttft_s=jitter(profile.step_seconds(p, 0)), planned_tokens=p)
        for _ in range(PLAN.repeats)
        for p in PLAN.prompt_tokens
    ]
    decodes = []
    for ctx in PLAN.context_tokens:
        for b in PLAN.batch_sizes:
            context = b * (ctx + PLAN.decode_tokens / 2)
            itl = jitter(profile.step_seconds(0, b, context_tokens=round(context)))
            decodes.append(DecodeSample(batch=b, context_tokens=context, itl_s=itl, gaps=PLAN.decode_tokens))
    return prefills, decodes


def _assert_recovers(fitted: CostProfile, rel: float) -> None:
    for name in ("step_overhead_s", "decode_s_per_seq", "s_per_context_token"):
        assert _close(getattr(fitted, name), getattr(KNOWN, name), rel), (name, getattr(fitted, name))
    assert [c for c, _ in fitted.prefill_s_per_token] == [c for c, _ in KNOWN.prefill_s_per_token]
    for (chunk, got), (_, want) in zip(fitted.prefill_s_per_token, KNOWN.prefill_s_per_token):
        assert _close(got, want, rel), (chunk, got, want)


def test_the_fit_recovers_a_known_profile_from_exact_measurements():
    prefills, decodes = _synthetic(KNOWN, noise=0.0)
    fit = fit_profile(prefills, decodes, name="fitted", source="synthetic", kv_bytes_per_token=1024)
    _assert_recovers(fit.profile, rel=1e-3)
    assert max(fit.ttft_errors) < 1e-3 and max(fit.itl_errors) < 1e-3
    assert fit.profile.source.startswith("synthetic; TTFT error median 0.0%, max 0.0% (9 requests); ITL error")
    assert CostProfile.from_dict(json.loads(json.dumps(fit.profile.to_dict()))) == fit.profile


def test_the_fit_stays_close_under_noise_and_states_its_error():
    prefills, decodes = _synthetic(KNOWN, noise=0.05, seed=3)
    fit = fit_profile(prefills, decodes, name="fitted", source="noisy", kv_bytes_per_token=1024)
    _assert_recovers(fit.profile, rel=0.2)
    assert 0 < max(fit.itl_errors) < 0.1
    lines = fit.report_lines()
    assert len(lines) == 2 + len(prefills) + len(decodes) + 1
    assert lines[-1] == fit.error_summary() and "ITL error median" in lines[-1]


def test_no_decode_term_is_fitted_below_zero():
    # gaps that shrink as the batch grows would want a negative per-sequence cost: it is held at zero
    decodes = [DecodeSample(batch=b, context_tokens=0.0, itl_s=0.02 - 0.001 * b, gaps=8) for b in (1, 2, 4, 8)]
    fit = fit_profile(
        [PrefillSample(prompt_tokens=16, ttft_s=0.05, planned_tokens=16)],
        decodes,
        name="clamped",
        source="synthetic",
        kv_bytes_per_token=1,
    )
    assert fit.profile.decode_s_per_seq == 0.0 and fit.profile.s_per_context_token == 0.0
    assert 0.01 < fit.profile.step_overhead_s < 0.02


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"prompt_tokens": (64, 16)}, "prompt_tokens must increase"),
        ({"prompt_tokens": ()}, "prompt_tokens must be a non-empty list"),
        ({"repeats": 0}, "repeats must be a positive integer, got 0"),
        ({"decode_tokens": 2}, "decode_tokens must be an integer >= 4, got 2"),
        ({"batch_sizes": (1,), "context_tokens": (16, 32)}, r"at least 2 batch_sizes and 2 context_tokens"),
        ({"context_tokens": (16,)}, r"to tell the 3 decode terms apart, got \[1, 2, 4, 8\] and \[16\]"),
        ({"batch_sizes": (0, 2)}, "each of calibration batch_sizes must be a positive integer, got 0"),
        ({"prompt_tokens": (1, 16)}, "each of calibration prompt_tokens must be an integer >= 2, got 1"),
    ],
)
def test_a_bad_plan_is_refused_by_its_field(changes, named):
    with pytest.raises(ConfigError, match=named):
        CalibrationPlan(**changes)


def test_too_few_measurements_are_refused():
    prefills, decodes = _synthetic(KNOWN, noise=0.0)
    with pytest.raises(ConfigError, match="at least 3 decode groups"):
        fit_profile(prefills, decodes[:2], name="x", source="y", kv_bytes_per_token=1)
    with pytest.raises(ConfigError, match="no prefill measurement"):
        fit_profile([], decodes, name="x", source="y", kv_bytes_per_token=1)


# -- a fake OpenAI server, timed by a known profile ---------------------------------------------


class _Sequence:
    def __init__(self, prompt_tokens: int, max_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.generated = 0
        self.tokens: Queue[int | None] = Queue()
        self.prompt = ""


class FakeEngine:
    """A continuous-batching loop paced by a profile: new prompts prefill whole in the next step."""

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self._cond = threading.Condition()
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self.prompts: list[str] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: str, max_tokens: int) -> _Sequence:
        seq = _Sequence(len(prompt.split()), max_tokens)
        with self._cond:
            self.prompts.append(prompt)
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def stop(self) -> None:
        self._stopped.set()
        with self._cond:
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        due = time.perf_counter()
        while not self._stopped.is_set():
            with self._cond:
                while not (self._waiting or self._running or self._stopped.is_set()):
                    self._cond.wait()
                new, self._waiting = self._waiting, []
            decoding = list(self._running)
            context = sum(s.prompt_tokens + s.generated - 1 for s in decoding)
            seconds = self.profile.step_seconds(
                sum(s.prompt_tokens for s in new), len(decoding), context_tokens=context
            )
            due = max(due, time.perf_counter()) + seconds
            self._stopped.wait(due - time.perf_counter())  # the step's modelled time passes
            self._running = decoding + new
            for seq in self._running:
                seq.generated += 1
                seq.tokens.put(seq.generated)
                if seq.generated == seq.max_tokens:
                    seq.tokens.put(None)
            self._running = [s for s in self._running if s.generated < s.max_tokens]


def _handler(engine: FakeEngine, mode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a request's TTFT pays no new connection

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if mode == "garbage models":
                self._send(200, b"<html>hello</html>", "text/html")
            elif mode == "error":
                self._send(500, b'{"error": "overloaded"}')
            else:
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode())

        def _event(self, data: str) -> None:
            """One server-sent event, as one HTTP/1.1 chunk (the connection stays open for the next request)."""
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if mode == "garbage stream":
                self._event("{not json")
            else:
                seq = engine.submit(body["prompt"], body["max_tokens"])
                while (n := seq.tokens.get()) is not None:
                    self._event(json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": f" t{n}"}]}))
                usage = {"prompt_tokens": seq.prompt_tokens, "completion_tokens": seq.generated}
                self._event(json.dumps({"choices": [], "usage": usage}))
                self._event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client closing its kept-alive connection at the end of a run is no error


@contextmanager
def fake_server(mode: str = "ok", engine: FakeEngine | None = None) -> Iterator[str]:
    engine = engine or FakeEngine(KNOWN)
    server = _QuietServer(("127.0.0.1", 0), _handler(engine, mode))
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        engine.stop()


def test_calibrating_a_live_server_recovers_its_profile():
    lines: list[str] = []
    engine = FakeEngine(KNOWN)
    with fake_server(engine=engine) as url:
        run, fit = calibrate(url, PLAN, kv_bytes_per_token=1024, progress=lines.append)
        again = CalibrationPlan(prompt_tokens=(16,), repeats=1, batch_sizes=(1, 2), context_tokens=(8, 16))
        measure(url, again)
    # no two prompts share their first 16 words, not even across runs: nothing can come from a prefix cache
    assert len(engine.prompts) == PLAN.num_requests + again.num_requests
    assert len({" ".join(p.split()[:16]) for p in engine.prompts}) == len(engine.prompts)
    assert run.model == "fake-model" and fit.profile.name == "fitted-fake-model"
    assert len(run.prefills) == 9 and len(run.decodes) == 6
    assert [p.prompt_tokens for p in run.prefills] == [16, 64, 256] * 3
    # the fake's steps take milliseconds, timed by the real clock on a shared machine: a wide tolerance
    fitted = fit.profile
    for name in ("step_overhead_s", "decode_s_per_seq", "s_per_context_token"):
        assert _close(getattr(fitted, name), getattr(KNOWN, name), 0.25), (name, getattr(fitted, name))
    assert statistics.median(fit.itl_errors) < 0.15
    # the time a request spends outside the steps (HTTP, here milliseconds under load) lands in the prefill
    # rates: never below the known ones, and a small share of the largest chunk's
    assert [c for c, _ in fitted.prefill_s_per_token] == [16, 64, 256]
    for (chunk, got), (_, want) in zip(fitted.prefill_s_per_token, KNOWN.prefill_s_per_token):
        assert got > 0.9 * want, (chunk, got, want)
    assert _close(fitted.prefill_s_per_token[-1][1], KNOWN.prefill_s_per_token[-1][1], 0.35)
    assert lines[0].startswith(f"calibrating against {url}, model 'fake-model': {PLAN.num_requests} requests")
    assert sum(line.startswith("decode group batch") for line in lines) == 6
    assert f"fitted by kvpool calibrate against {url}, model 'fake-model'" in fit.profile.source
    assert "ITL error median" in fit.profile.source


def test_the_command_writes_a_profile_load_profile_reads(tmp_path):
    out = tmp_path / "fitted.json"
    with fake_server() as url:
        result = CliRunner().invoke(
            cli,
            ["calibrate", url, "--kv-bytes-per-token", "1024", "--name", "fake-cpu", "--output", str(out)]
            + ["--prompt-tokens", "16,64,256", "--repeats", "1", "--batch-sizes", "1,2,4"]
            + ["--context-tokens", "16,64", "--decode-tokens", "6", "--server-command", "fake_server()"],
        )
    assert result.exit_code == 0, result.output
    profile = load_profile(str(out))
    assert profile.name == "fake-cpu" and profile.kv_bytes_per_token == 1024
    assert f"{url} (fake_server())" in profile.source
    assert "TTFT error median" in result.stderr and "calibrate " in result.stderr
    assert f"wrote profile 'fake-cpu' to {out}" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_the_command_refuses_an_unreachable_url_by_name():
    url = f"http://127.0.0.1:{_free_port()}"
    result = CliRunner().invoke(cli, ["calibrate", url, "--kv-bytes-per-token", "1024"])
    assert result.exit_code == 1
    assert f"kvpool calibrate: error: the server at {url} cannot be reached" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("mode", "status", "named"),
    [
        ("garbage models", 2, "is not an OpenAI-compatible server: GET /v1/models should list models"),
        ("garbage stream", 2, "each stream event should be a JSON completion chunk with 'choices'"),
        ("error", 1, "answered GET /v1/models with HTTP 500"),
    ],
)
def test_the_command_names_a_server_answering_garbage(mode, status, named):
    with fake_server(mode) as url:
        result = CliRunner().invoke(cli, ["calibrate", url, "--kv-bytes-per-token", "1024"])
    assert result.exit_code == status, result.output
    assert f"kvpool calibrate: error: the server at {url}" in result.stderr and named in result.stderr
    assert "Traceback" not in result.output


def test_the_library_raises_by_whose_fault_it_is():
    with fake_server("garbage stream") as url, pytest.raises(ExternalDataError, match=url):
        calibrate(url, PLAN, kv_bytes_per_token=1)
    with fake_server("error") as url, pytest.raises(ServiceError, match="HTTP 500"):
        calibrate(url, PLAN, kv_bytes_per_token=1)
    with pytest.raises(ConfigError, match="must start with http:// or https://, got 'localhost:8000'"):
        calibrate("localhost:8000", PLAN, kv_bytes_per_token=1)
    with fake_server() as url, pytest.raises(ConfigError, match="does not serve model 'other'; it serves"):
        calibrate(url, PLAN, kv_bytes_per_token=1, model="other")


@pytest.mark.parametrize("name", ["smollm2-135m-vllm-cpu", "smollm2-135m-kvpool-cpu"])
def test_the_shipped_fitted_profiles_name_their_server_run_and_error(name):
    profile = load_profile(name)
    assert profile.source.startswith("fitted by kvpool calibrate against http://127.0.0.1:")
    assert " UTC on " in profile.source and "CPUs" in profile.source  # when and on which machine
    assert "TTFT error median" in profile.source and "ITL error median" in profile.source
    assert profile.prefill_s_per_token[0][0] == 16 and profile.step_overhead_s > 0


def test_a_decode_group_counts_only_the_gaps_while_all_its_sequences_decode():
    from kvpool.calibration import _decode_sample, _Stream

    # A's first token at 0.0 (alone), B's at 0.1; A ends at 0.4, B at 0.5: the window is [0.1, 0.4]
    a = _Stream(sent=0.0, token_times=[0.0, 0.1, 0.2, 0.3, 0.4], prompt_tokens=10, completion_tokens=5)
    b = _Stream(sent=0.0, token_times=[0.1, 0.2, 0.3, 0.45, 0.5], prompt_tokens=10, completion_tokens=5)
    sample = _decode_sample([[a, b]], planned_tokens=99)
    assert sample is not None
    # A's gaps after its tokens 1, 2, 3; B's after 0, 1 (its 0.3 -> 0.45 gap ends past the window)
    assert sample.gaps == 5 and sample.batch == 2
    assert sample.itl_s == pytest.approx(0.1)
    assert sample.context_tokens == pytest.approx(2 * (11 + 12 + 13 + 10 + 11) / 5)
    # no server count: the planned length stands in for the prompt
    a.prompt_tokens = b.prompt_tokens = None
    again = _decode_sample([[a, b]], planned_tokens=20)
    assert again is not None and again.context_tokens == pytest.approx(2 * (21 + 22 + 23 + 20 + 21) / 5)
