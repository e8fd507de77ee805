"""The start-up profile pass is bounded in time, and its peak stays an upper bound (issue 31).

A fake clock advances by a fixed time per token each measured pass runs (a slow
or busy machine, without waiting on wall time), and a fake measure reports an
affine peak (a fixed part plus a part per token, as a step's activations are),
so what the profile makes of a smaller pass can be checked against the full
pass's figure exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvpool.engine import startup as engine_startup
from kvpool.engine.startup import PROFILE_BUDGET_S, PROFILE_PROBE_TOKENS, EngineOptions, start_engine
from kvpool.engine.threads import ThreadGovernor
from tests.engine.tiny_models import build_model, save_model

pytestmark = pytest.mark.engine

FULL = 256  # max_num_batched_tokens: four probes
FIXED = 10_000  # bytes a pass holds whatever its tokens
PER_TOKEN = 300  # bytes per token


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(build_model("llama", max_position_embeddings=512), tmp_path_factory.mktemp("llama"))


class SlowMachine:
    """A clock that a measured pass advances by ``seconds_per_token`` for each token it runs."""

    def __init__(self, seconds_per_token: float) -> None:
        self.now = 0.0
        self.per_token = seconds_per_token
        self.passes: list[int] = []  # tokens of each measured pass, in order
        self.governors: list[object] = []

    def clock(self) -> float:
        return self.now

    def measure(self, device: torch.device, work: functools.partial) -> int:
        batch = work.args[0]
        tokens = sum(len(chunk.token_ids) for chunk in batch)
        self.governors.append(work.func.__self__.thread_governor)
        work()  # the real pass on the tiny model
        self.passes.append(tokens)
        self.now += tokens * self.per_token
        return FIXED + PER_TOKEN * tokens


def start(folder, machine: SlowMachine, monkeypatch, lines=None, **options):
    bounded = functools.partial(engine_startup._profile, clock=machine.clock, measure=machine.measure)
    monkeypatch.setattr(engine_startup, "_profile", bounded)
    fields = dict(model=folder, block_size=4, kv_cache_memory=512 * 1024, max_num_batched_tokens=FULL,
                  max_num_seqs=8, max_model_len=512, threads=1)  # fmt: skip
    fields.update(options)
    return start_engine(EngineOptions(**fields), (lines if lines is not None else []).append)


def attention_bound(setup, tokens: int = FULL) -> int:
    return setup.runner.attention_workspace_bytes(max_num_tokens=tokens, max_num_seqs=8, max_model_len=512)


def test_a_quiet_machine_measures_the_full_step(folder, monkeypatch):
    machine = SlowMachine(seconds_per_token=0.001)  # 0.26 s for the full pass: within the budget
    lines: list[str] = []
    setup = start(folder, machine, monkeypatch, lines)
    assert machine.passes == [PROFILE_PROBE_TOKENS, FULL]
    assert setup.memory.profile_tokens == FULL
    assert setup.memory.peak_activation_bytes == FIXED + PER_TOKEN * FULL + attention_bound(setup)
    assert not any("scaled" in line for line in lines)


@pytest.mark.parametrize(
    ("seconds_per_token", "passes"),
    [
        pytest.param(
            0.03, [PROFILE_PROBE_TOKENS, int((PROFILE_BUDGET_S - 0.03 * 64) / 0.03)], id="a-smaller-pass-fits"
        ),
        pytest.param(1.0, [PROFILE_PROBE_TOKENS], id="only-the-probe"),
    ],
)
def test_a_slow_machine_measures_less_and_scales_up(folder, monkeypatch, seconds_per_token, passes):
    machine = SlowMachine(seconds_per_token)
    lines: list[str] = []
    setup = start(folder, machine, monkeypatch, lines)
    assert machine.passes == passes
    measured = passes[-1]
    assert setup.memory.profile_tokens == measured
    # Bounded: the passes after the probe took at most what the budget left.
    assert sum(passes[1:]) * seconds_per_token <= max(PROFILE_BUDGET_S - PROFILE_PROBE_TOKENS * seconds_per_token, 0)
    # Safe: never below the full pass's peak, and exactly the measured pass's figure scaled.
    full_pass = FIXED + PER_TOKEN * FULL
    peak = setup.memory.peak_activation_bytes - attention_bound(setup)
    assert peak >= full_pass
    assert peak == -(-(FIXED + PER_TOKEN * measured) * FULL // measured)
    assert any(f"{measured} tokens (max_num_batched_tokens {FULL})" in line and "scaled" in line for line in lines)


def test_a_step_no_bigger_than_the_probe_is_measured_once(folder, monkeypatch):
    machine = SlowMachine(seconds_per_token=1.0)
    setup = start(folder, machine, monkeypatch, max_num_batched_tokens=32)
    assert machine.passes == [32]
    assert setup.memory.peak_activation_bytes == FIXED + PER_TOKEN * 32 + attention_bound(setup, 32)


def test_the_governor_sets_the_threads_of_the_profile_passes(folder, monkeypatch):
    machine = SlowMachine(seconds_per_token=0.001)
    setup = start(folder, machine, monkeypatch)
    governor = setup.runner.thread_governor
    assert isinstance(governor, ThreadGovernor)
    assert machine.governors == [governor, governor]  # the served steps' governor, before each pass
    none = start(folder, SlowMachine(seconds_per_token=0.001), monkeypatch, threads=None)
    assert none.runner.thread_governor is None


def test_auto_never_exceeds_torchs_count_at_start(folder, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup = start(folder, SlowMachine(seconds_per_token=0.001), monkeypatch, threads="auto")
        assert setup.runner.thread_governor.threads == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_threads_default_to_auto():
    assert EngineOptions(model="no-such-model").threads == "auto"
