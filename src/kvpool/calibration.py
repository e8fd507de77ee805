"""Fitting a cost profile to a live OpenAI-compatible server: the rules behind ``kvpool calibrate``.

A calibration is a short, planned run of streamed ``/v1/completions`` requests, then a fit::

    prefill phase   one request at a time, max_tokens=1, prompts of several lengths
                    TTFT(P)      = step_overhead_s + P x rate(P)
    decode phase    B requests at once with prompts of L tokens, each decoding N tokens
                    ITL(B, ctx)  = step_overhead_s + decode_s_per_seq x B + s_per_context_token x ctx

``ctx`` is the context every step of the group reads: the sum over its B sequences of the tokens
already in their KV cache (prompt plus output so far). Only the gaps measured while all B requests
decode count (after the last one's first token, before the first one's last), so a group's prefills
never leak into its decode time. The three decode terms are fitted by least squares on relative
error, none below zero; ``rate`` at each planned prompt length is then the median over the repeats of
``(TTFT - step_overhead_s) / P``. Time a server spends on a request outside its steps (HTTP,
tokenizing) has no field of its own in a :class:`~kvpool.cost_model.CostProfile`: it lands in the
prefill rates, which is where an emulated replica pays it back (its first token comes that much later).

Every prompt is random words, drawn afresh each run, so no two share a first block and nothing is served
from a prefix cache (not even the previous run's prompts). The fit's error is stated per measurement: the relative error of the
profile's prediction against each TTFT and each group's median inter-token gap (median and max), and it
is written into the profile's ``source`` with the server, the time and the machine.

The HTTP part needs ``httpx`` (the ``route`` or ``serve`` extra), imported when a run starts; the plan,
the measurements and the fit are standard library only. Errors say who is at fault: a plan or option out
of range is a :class:`~kvpool.errors.ConfigError`; a server that cannot be reached or answers with an
HTTP error is a :class:`~kvpool.errors.ServiceError`; an answer that is not what an OpenAI server sends
is an :class:`~kvpool.errors.ExternalDataError`. Each names the URL.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import combinations

from kvpool.checks import check_int
from kvpool.cost_model import CostProfile
from kvpool.errors import ConfigError, ExternalDataError, ServiceError

__all__ = [
    "CalibrationFit",
    "CalibrationPlan",
    "DecodeSample",
    "Measurements",
    "PrefillSample",
    "calibrate",
    "fit_profile",
    "machine_description",
    "measure",
]

#: Words most BPE vocabularies hold as one token with its leading space: a prompt of N of them is about N tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his her it an are be or had not but this which "
    "they have one you were all their we there been has when who more will would no out if so can what up "
    "said about other into than its time only new some could these two may first then do any like my now "
    "over such our man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three"
).split()


def _count_list(name: str, values: object, *, minimum: int = 1) -> tuple[int, ...]:
    """A non-empty, strictly increasing tuple of integers >= ``minimum``; ConfigError naming ``name`` otherwise."""
    if isinstance(values, str | bytes) or not isinstance(values, tuple | list) or not values:
        raise ConfigError(f"calibration {name} must be a non-empty list of integers, got {values!r}")
    out: list[int] = []
    for value in values:
        check_int(f"each of calibration {name}", value, minimum=minimum)
        if out and value <= out[-1]:
            raise ConfigError(f"calibration {name} must increase, got {value} after {out[-1]}")
        out.append(value)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationPlan:
    """Which requests a calibration sends. Checked at construction (``ConfigError`` naming the field).

    ``prompt_tokens``: the prefill points (prompt lengths, each also a chunk size of the profile), each sent
    ``repeats`` times alone with ``max_tokens=1``. ``batch_sizes`` x ``context_tokens``: the decode groups,
    each ``batch`` requests at once with prompts of that many tokens, each decoding ``decode_tokens``, each
    group ``repeats`` times. A server must take prompts of ``max(prompt_tokens, context_tokens) + decode_tokens`` tokens; the prefill points
    should stay within its step's token budget (one chunk), or the point measures several steps.
    """

    prompt_tokens: tuple[int, ...] = (16, 64, 256, 1024)
    repeats: int = 3
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_tokens: tuple[int, ...] = (32, 768)
    decode_tokens: int = 24

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "prompt_tokens", _count_list("prompt_tokens", self.prompt_tokens, minimum=2))
        put(self, "batch_sizes", _count_list("batch_sizes", self.batch_sizes))
        put(self, "context_tokens", _count_list("context_tokens", self.context_tokens, minimum=2))
        check_int("calibration repeats", self.repeats)
        check_int("calibration decode_tokens", self.decode_tokens, minimum=4)  # gaps after the group's prefills
        if len(self.batch_sizes) < 2 or len(self.context_tokens) < 2:
            # one batch size leaves the overhead and the per-sequence cost one term; one context length
            # makes the context each step reads proportional to the batch
            raise ConfigError(
                f"calibration needs at least 2 batch_sizes and 2 context_tokens to tell the 3 decode terms "
                f"apart, got {list(self.batch_sizes)} and {list(self.context_tokens)}"
            )

    @property
    def num_requests(self) -> int:
        """Requests the plan sends (the warm-up included)."""
        decodes = sum(self.batch_sizes) * len(self.context_tokens)
        return 1 + (len(self.prompt_tokens) + decodes) * self.repeats


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One request sent alone: its prompt's tokens and its time to first token."""

    prompt_tokens: int
    ttft_s: float
    #: The planned length this request measures (its prompt_tokens is what the server counted).
    planned_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decode group: ``batch`` sequences decoding together, the context its steps read, its median gap."""

    batch: int
    #: Mean over the measured gaps of the context the step read, summed over the group's sequences.
    context_tokens: float
    itl_s: float
    gaps: int


@dataclass(frozen=True, slots=True)
class Measurements:
    """What a calibration run measured, and against what."""

    url: str
    model: str
    prefills: tuple[PrefillSample, ...]
    decodes: tuple[DecodeSample, ...]
    started_at: datetime
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationFit:
    """A fitted profile and its error: the relative error of each prediction against its measurement."""

    profile: CostProfile
    #: (prompt tokens, measured TTFT, predicted TTFT) per prefill request.
    ttft: tuple[tuple[int, float, float], ...]
    #: (batch, context tokens, measured ITL, predicted ITL) per decode group.
    itl: tuple[tuple[int, float, float, float], ...]

    @property
    def ttft_errors(self) -> tuple[float, ...]:
        return tuple(abs(pred - got) / got for _, got, pred in self.ttft)

    @property
    def itl_errors(self) -> tuple[float, ...]:
        return tuple(abs(pred - got) / got for _, _, got, pred in self.itl)

    def error_summary(self) -> str:
        """``TTFT error median 3.1%, max 9.0% (12 requests); ITL error median ...``."""

        def one(label: str, errors: tuple[float, ...], unit: str) -> str:
            return (
                f"{label} error median {100 * statistics.median(errors):.1f}%, max {100 * max(errors):.1f}% "
                f"({len(errors)} {unit})"
            )

        return "; ".join((one("TTFT", self.ttft_errors, "requests"), one("ITL", self.itl_errors, "decode groups")))

    def report_lines(self) -> list[str]:
        """The fit, one measurement a line, then the summary: what ``kvpool calibrate`` prints."""
        lines = ["prefill: prompt tokens, TTFT measured -> predicted (error)"]
        for tokens, got, pred in self.ttft:
            lines.append(f"  {tokens:6d}  {1e3 * got:9.2f} ms -> {1e3 * pred:9.2f} ms ({_signed(pred, got)})")
        lines.append("decode: batch, context tokens, ITL measured -> predicted (error)")
        for batch, ctx, got, pred in self.itl:
            lines.append(
                f"  {batch:3d}  {ctx:9.0f}  {1e3 * got:9.2f} ms -> {1e3 * pred:9.2f} ms ({_signed(pred, got)})"
            )
        lines.append(self.error_summary())
        return lines


def _signed(pred: float, got: float) -> str:
    return f"{100 * (pred - got) / got:+.1f}%"


# -- the fit ------------------------------------------------------------------------------------


def _solve(rows: Sequence[Sequence[float]], rhs: Sequence[float]) -> list[float] | None:
    """Least squares for a few unknowns by the normal equations; None when they are singular."""
    n = len(rows[0])
    a = [
        [sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, rhs))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        scale = max(abs(v) for row in a for v in row[:n]) or 1.0
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [v - factor * w for v, w in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _fit_decode(decodes: Sequence[DecodeSample]) -> tuple[float, float, float]:
    """(step_overhead_s, decode_s_per_seq, s_per_context_token): least squares on relative error, none below 0.

    Three unknowns: every subset of them is solved with the others held at zero, and the feasible
    solution with the least squared relative error wins (an exact non-negative least squares).
    """
    design = [(1.0, float(d.batch), d.context_tokens) for d in decodes]
    best: tuple[float, tuple[float, float, float]] | None = None
    for size in (3, 2, 1):
        for free in combinations(range(3), size):
            rows = [[row[i] / d.itl_s for i in free] for row, d in zip(design, decodes)]
            solved = _solve(rows, [1.0] * len(decodes))
            if solved is None or min(solved) < 0:
                continue
            coef = [0.0, 0.0, 0.0]
            for i, value in zip(free, solved):
                coef[i] = value
            cost = sum((sum(c * x for c, x in zip(coef, row)) / d.itl_s - 1) ** 2 for row, d in zip(design, decodes))
            if best is None or cost < best[0] - 1e-15:
                best = (cost, (coef[0], coef[1], coef[2]))
    if best is None:  # pragma: no cover - a single free term always solves when any measurement is > 0
        raise ConfigError("the decode measurements cannot be fitted (every inter-token gap is zero)")
    return best[1]


def fit_profile(
    prefills: Sequence[PrefillSample],
    decodes: Sequence[DecodeSample],
    *,
    name: str,
    source: str,
    kv_bytes_per_token: int,
) -> CalibrationFit:
    """The profile that fits ``prefills`` and ``decodes``, and its error against each of them.

    ``source`` is completed with the fit's error summary. ConfigError when there is too little to fit:
    no prefill sample, fewer than 3 decode groups, or a measurement that is not a positive time.
    """
    if not prefills:
        raise ConfigError("calibration has no prefill measurement to fit")
    if len(decodes) < 3:
        raise ConfigError(f"calibration needs at least 3 decode groups to fit, got {len(decodes)}")
    for p in prefills:
        if not (p.prompt_tokens >= 1 and 0 < p.ttft_s < math.inf):
            raise ConfigError(f"a prefill measurement must have tokens >= 1 and a positive time, got {p!r}")
    for d in decodes:
        if not (d.batch >= 1 and d.context_tokens >= 0 and 0 < d.itl_s < math.inf):
            raise ConfigError(f"a decode measurement must have batch >= 1 and a positive time, got {d!r}")
    overhead, per_seq, per_ctx = _fit_decode(decodes)

    by_plan: dict[int, list[PrefillSample]] = {}
    for p in prefills:
        by_plan.setdefault(p.planned_tokens, []).append(p)
    points: list[tuple[int, float]] = []
    for planned in sorted(by_plan):
        group = by_plan[planned]
        chunk = round(statistics.median(p.prompt_tokens for p in group))
        rate = statistics.median(max(0.0, (p.ttft_s - overhead) / p.prompt_tokens) for p in group)
        if points and chunk <= points[-1][0]:  # two planned lengths the server counted alike: one point
            chunk, rate = points[-1][0], (points[-1][1] + rate) / 2
            points.pop()
        points.append((chunk, rate))

    draft = CostProfile(
        name=name,
        source=source,
        step_overhead_s=_round(overhead),
        prefill_s_per_token=tuple((c, _round(r)) for c, r in points),
        decode_s_per_seq=_round(per_seq),
        s_per_context_token=_round(per_ctx),
        kv_bytes_per_token=kv_bytes_per_token,
    )
    ttft = tuple((p.prompt_tokens, p.ttft_s, draft.step_seconds(p.prompt_tokens, 0)) for p in prefills)
    itl = tuple(
        (d.batch, d.context_tokens, d.itl_s, draft.step_seconds(0, d.batch, context_tokens=round(d.context_tokens)))
        for d in decodes
    )
    fit = CalibrationFit(profile=draft, ttft=ttft, itl=itl)
    return CalibrationFit(profile=draft.with_fields(source=f"{source}; {fit.error_summary()}"), ttft=ttft, itl=itl)


def _round(value: float) -> float:
    """Four significant digits: what the measurements can tell apart."""
    return float(f"{value:.4g}") if value > 0 else 0.0


# -- the run ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Stream:
    """One streamed completion as the client saw it."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Client:
    """The few calls a calibration makes, each answer checked; errors name the URL."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float, clock: Callable[[], float]) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, limits=limits)
        self._clock = clock
        self._httpx = httpx

    async def close(self) -> None:
        await self._http.aclose()

    def _unreachable(self, exc: Exception, what: str) -> ServiceError:
        detail = str(exc) or type(exc).__name__
        return ServiceError(f"the server at {self.url} cannot be reached ({what}: {detail})")

    def _garbage(self, what: str, got: object) -> ExternalDataError:
        text = repr(got)
        return ExternalDataError(
            f"the server at {self.url} is not an OpenAI-compatible server: {what}, got {text[:200]}"
        )

    async def model(self, wanted: str | None) -> str:
        """The model to ask for: ``wanted`` if the server lists it, else the only one it lists."""
        try:
            response = await self._http.get("/v1/models")
        except self._httpx.HTTPError as exc:
            raise self._unreachable(exc, "GET /v1/models") from None
        if response.status_code != 200:
            raise ServiceError(
                f"the server at {self.url} answered GET /v1/models with HTTP {response.status_code}: "
                f"{response.text[:200]!r}"
            )
        try:
            ids: list[str] = [m["id"] for m in response.json()["data"]]
            if not ids or not all(isinstance(i, str) for i in ids):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise self._garbage("GET /v1/models should list models as {'data': [{'id': ...}]}", response.text) from None
        if wanted is None:
            if len(ids) > 1:
                raise ConfigError(f"the server at {self.url} serves {ids}: name one with --model")
            return ids[0]
        if wanted not in ids:
            raise ConfigError(f"the server at {self.url} does not serve model {wanted!r}; it serves {ids}")
        return wanted

    async def complete(self, model: str, prompt: str, max_tokens: int) -> _Stream:
        """Stream one completion; the time each chunk carrying a token arrived, and the usage."""
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        record = _Stream(sent=self._clock())
        done = False
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    raise ServiceError(
                        f"the server at {self.url} answered POST /v1/completions with HTTP "
                        f"{response.status_code}: {text[:300]!r}"
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        if line.strip() and not line.startswith((":", "event:", "id:", "retry:")):
                            raise self._garbage("a completion stream should be server-sent events", line)
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    self._chunk(record, data)
        except self._httpx.HTTPError as exc:
            raise self._unreachable(exc, "POST /v1/completions") from None
        if not done:
            raise self._garbage("a completion stream should end with 'data: [DONE]'", "a stream without it")
        if not record.token_times:
            raise self._garbage("a completion stream should carry at least one token", "none")
        return record

    def _chunk(self, record: _Stream, data: str) -> None:
        now = self._clock()
        try:
            chunk = json.loads(data)
            choices = chunk["choices"]
            if not isinstance(choices, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise self._garbage("each stream event should be a JSON completion chunk with 'choices'", data) from None
        if choices:
            record.token_times.append(now)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                record.prompt_tokens, record.completion_tokens = prompt, completion


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _decode_sample(runs: Sequence[Sequence[_Stream]], planned_tokens: int) -> DecodeSample | None:
    """A group's median gap while every sequence of its run decoded, over its runs, and the context they read.

    Each run is the group's ``batch`` streams sent at once; its window opens at the last first token and
    closes at the first last token, so no gap there shares its step with a prefill.
    """
    gaps: list[float] = []
    positions: list[float] = []
    for streams in runs:
        start = max(s.token_times[0] for s in streams)
        end = min(s.token_times[-1] for s in streams)
        for s in streams:
            prompt = s.prompt_tokens if s.prompt_tokens is not None else planned_tokens
            times = s.token_times
            for k in range(len(times) - 1):
                if times[k] >= start and times[k + 1] <= end:
                    gaps.append(times[k + 1] - times[k])
                    positions.append(prompt + k)  # the step after token k reads the prompt and k output tokens
    if not gaps:
        return None
    return DecodeSample(
        batch=len(runs[0]),
        context_tokens=len(runs[0]) * statistics.fmean(positions),
        itl_s=statistics.median(gaps),
        gaps=len(gaps),
    )


async def _measure(
    client: _Client,
    plan: CalibrationPlan,
    model: str | None,
    progress: Callable[[str], None],
    clock: Callable[[], float],
) -> Measurements:
    started_at, t0 = datetime.now(UTC), clock()
    name = await client.model(model)
    progress(f"calibrating against {client.url}, model {name!r}: {plan.num_requests} requests")
    rng = random.Random(os.urandom(16))  # new words every run: a server's prefix cache holds the last run's
    await client.complete(name, _prompt(rng, plan.prompt_tokens[0]), 2)  # warm-up, not measured

    prefills: list[PrefillSample] = []
    for _ in range(plan.repeats):  # lengths in turn, so a drift in the machine's load spreads over all
        for planned in plan.prompt_tokens:
            s = await client.complete(name, _prompt(rng, planned), 1)
            tokens = s.prompt_tokens if s.prompt_tokens is not None else planned
            prefills.append(
                PrefillSample(prompt_tokens=tokens, ttft_s=s.token_times[0] - s.sent, planned_tokens=planned)
            )
            progress(
                f"prefill {len(prefills)}/{len(plan.prompt_tokens) * plan.repeats}: {tokens} prompt tokens, "
                f"TTFT {1e3 * prefills[-1].ttft_s:.1f} ms"
            )

    groups = [(b, ctx) for ctx in plan.context_tokens for b in plan.batch_sizes]
    runs: dict[tuple[int, int], list[list[_Stream]]] = {group: [] for group in groups}
    for rep in range(plan.repeats):  # every group once, then again: load drift spreads over all of them
        for i, (batch, ctx) in enumerate(groups, 1):
            prompts = [_prompt(rng, ctx) for _ in range(batch)]
            streams = await asyncio.gather(*(client.complete(name, p, plan.decode_tokens) for p in prompts))
            runs[batch, ctx].append(list(streams))
            progress(f"decode group {i + rep * len(groups)}/{len(groups) * plan.repeats}: batch {batch} x {ctx} tokens")
    decodes: list[DecodeSample] = []
    for batch, ctx in groups:
        sample = _decode_sample(runs[batch, ctx], ctx)
        if sample is None:
            progress(f"decode group batch {batch} x {ctx} tokens: no gap while all its sequences decoded, left out")
            continue
        decodes.append(sample)
        progress(
            f"decode group batch {batch} x {ctx} tokens: {sample.context_tokens:.0f} context tokens, "
            f"ITL {1e3 * sample.itl_s:.2f} ms (median of {sample.gaps} gaps)"
        )
    return Measurements(
        url=client.url,
        model=name,
        prefills=tuple(prefills),
        decodes=tuple(decodes),
        started_at=started_at,
        seconds=clock() - t0,
    )


def measure(
    url: str,
    plan: CalibrationPlan,
    *,
    model: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 300.0,
    progress: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.perf_counter,
) -> Measurements:
    """Send ``plan``'s requests to the OpenAI-compatible server at ``url`` and time them.

    ``model``: the model to ask for (None: the one the server lists). ``progress`` gets a line per
    measurement. ``clock`` times the chunks (seconds, monotonic).
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"a calibration URL must start with http:// or https://, got {url!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise ConfigError(f"a calibration timeout must be a positive number of seconds, got {timeout_s!r}")

    async def run() -> Measurements:
        client = _Client(url, api_key, float(timeout_s), clock)
        try:
            return await _measure(client, plan, model, progress, clock)
        finally:
            await client.close()

    return asyncio.run(run())


def machine_description() -> str:
    """``host (N CPUs, CPU model, load a/b/c)``: the machine a profile was fitted on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = "load " + "/".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "load unknown"
    return f"{platform.node() or 'unknown host'} ({os.cpu_count()} CPUs, {cpu}, {load})"


def calibrate(
    url: str,
    plan: CalibrationPlan,
    *,
    kv_bytes_per_token: int,
    name: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    server_command: str | None = None,
    timeout_s: float = 300.0,
    progress: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Measurements, CalibrationFit]:
    """Measure the server at ``url`` with ``plan``, then fit a profile named ``name`` to what it measured.

    ``name`` None: ``fitted-`` and the last path part of the model's name (``fitted-smollm2-135m``).
    The profile's ``source`` names the server (``server_command``: how it was started, when given), the
    model, the time, the machine (before the run) and the fit's error.
    """
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"a calibrated profile needs a non-empty name, got {name!r}")
    if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token < 1:
        raise ConfigError(f"kv_bytes_per_token must be an integer >= 1, got {kv_bytes_per_token!r}")
    machine = machine_description()
    run = measure(url, plan, model=model, api_key=api_key, timeout_s=timeout_s, progress=progress, clock=clock)
    server = f"{url} ({server_command})" if server_command else url
    source = (
        f"fitted by kvpool calibrate against {server}, model {run.model!r}, at "
        f"{run.started_at:%Y-%m-%d %H:%M} UTC on {machine}: {len(run.prefills)} prefill requests of "
        f"{list(plan.prompt_tokens)} tokens, {len(run.decodes)} decode groups of batch {list(plan.batch_sizes)} x "
        f"context {list(plan.context_tokens)} tokens decoding {plan.decode_tokens} each, {plan.repeats} runs a group, in {run.seconds:.0f} s"
    )
    name = name or "fitted-" + run.model.rstrip("/").split("/")[-1]
    fit = fit_profile(run.prefills, run.decodes, name=name, source=source, kv_bytes_per_token=kv_bytes_per_token)
    return run, fit
