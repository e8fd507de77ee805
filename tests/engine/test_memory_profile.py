"""The startup profile bounds every step the engine serves.

The engine measures one pass at startup and adds what attention may hold over
long contexts (:meth:`ModelRunner.attention_workspace_bytes`). Here both sides
are measured with one instrument, an allocation tracker that sees every tensor
torch ops create (resident-set figures are too coarse for a model this small):
the profile pass through startup's own code path, then each step of a served
mixed workload and of hand-made worst cases. No step may exceed the profile.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kvpool.engine import startup as engine_startup
from kvpool.engine.batch import SequenceChunk
from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from tests.engine.tiny_models import build_model, random_prompt, save_model

pytestmark = pytest.mark.engine

BLOCK = 4
MAX_LEN = 256
BUDGET = 32
MAX_SEQS = 8


class AllocationTracker(TorchDispatchMode):
    """Bytes held by the tensors torch ops allocate while active: now, and at the peak.

    A storage counts from the op that creates it until its last tensor is gone;
    outputs that share an input's storage (views, in-place ops, writes into the
    KV cache) are not new memory. Allocations inside a fused kernel are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._live_ptrs: set[int] = set()

    def _release(self, ptr: int, nbytes: int) -> None:
        self._live_ptrs.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._live_ptrs:
                continue
            self._live_ptrs.add(ptr)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, ptr, nbytes)
        return out


def tracked_peak(work) -> int:
    """Peak bytes newly allocated while ``work()`` runs."""
    with AllocationTracker() as tracker:
        work()
    return tracker.peak


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(build_model("llama", max_position_embeddings=MAX_LEN), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def profiled(folder):
    """An LLM whose startup profile was measured with the tracker; (llm, measured pass alone)."""
    measured: list[int] = []

    def measure(device, work):
        measured.append(tracked_peak(work))
        return measured[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_startup, "measure_peak", measure)
        llm = LLM(
            folder, block_size=BLOCK, kv_cache_memory=2 * 2 * BLOCK * 2 * 16 * 4 * 600, max_model_len=MAX_LEN,
            max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, log=lambda line: None,
        )  # fmt: skip
    return llm, measured[0]


def record_steps(runner) -> list[int]:
    """Make ``runner.execute`` record each step's tracked peak."""
    peaks: list[int] = []
    execute = runner.execute

    def recorded(chunks):
        with AllocationTracker() as tracker:
            result = execute(chunks)
        peaks.append(tracker.peak)
        return result

    runner.execute = recorded
    return peaks


def test_tracker_counts_what_ops_allocate():
    keep = torch.zeros(10)
    with AllocationTracker() as tracker:
        a = torch.ones(1000)  # 4,000 bytes
        b = a * 2  # 4,000 more, both alive
        del a, b
        c = torch.empty(500)  # 2,000: the peak was earlier
        keep.add_(1)  # in place: nothing new
        view = keep[2:]  # a view: nothing new
    assert tracker.peak == 8000
    assert tracker.live == 2000
    del c, view


def test_served_mixed_steps_stay_within_the_profile(profiled):
    llm, measured_pass = profiled
    profile = llm.engine.setup.memory.peak_activation_bytes
    peaks = record_steps(llm.engine.runner)
    # One long conversation beside many short requests: chunks of the long prompt
    # share steps with decodes, and the long one decodes near max_model_len.
    long_prompt = random_prompt(MAX_LEN - 30, seed=1)
    short = [random_prompt(8 + i, seed=10 + i) for i in range(MAX_SEQS)]
    outs = llm.generate([long_prompt] + short, SamplingParams(max_tokens=24, ignore_eos=True))
    assert all(o.num_output_tokens == 24 for o in outs)
    assert len(peaks) > 20
    assert max(peaks) <= profile, (max(peaks), profile)
    # The workload reaches past what the plain pass shows: the attention bound is needed.
    assert max(peaks) > measured_pass


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([(MAX_LEN - BUDGET, BUDGET)], id="longest-chunk-at-the-end-of-the-context"),
        pytest.param([(MAX_LEN - 1, 1)] * MAX_SEQS, id="every-sequence-decoding-at-max-len"),
        pytest.param([(MAX_LEN - 25, 25)] + [(MAX_LEN - 1 - 9 * i, 1) for i in range(MAX_SEQS - 1)], id="mixed"),
        pytest.param([(0, BUDGET - MAX_SEQS + 1)] + [(4 * i + 3, 1) for i in range(MAX_SEQS - 1)], id="fresh"),
    ],
)
def test_worst_steps_stay_within_the_profile(profiled, parts):
    llm, _ = profiled
    runner = llm.engine.runner
    profile = llm.engine.setup.memory.peak_activation_bytes
    chunks, next_block = [], 1
    for i, (start, n) in enumerate(parts):
        blocks = -(-(start + n) // BLOCK)
        table = tuple(range(next_block, next_block + blocks))
        next_block += blocks
        chunks.append(SequenceChunk(f"s{i}", tuple(random_prompt(n, seed=i)), start, (table,)))
    assert next_block <= runner.num_blocks
    peak = tracked_peak(lambda: runner.execute(chunks))
    assert peak <= profile, (peak, profile)
