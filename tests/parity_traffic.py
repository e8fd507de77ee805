"""Seeded serving traffic for comparing kvpool's manager with vLLM's, and its replay.

One traffic driver, two sinks:

* :func:`generate` drives a *reference* manager (vLLM's, through
  ``benchmarks/vllm_reference.py``) the way a scheduler would and yields one
  record per operation, holding both the operation and the reference's
  decision: admissions and re-admissions (hit count, hit block IDs, new block
  table), prefill chunks and decodes (new blocks, or ``None`` when refused),
  frees, preemptions, ``reset_prefix_cache`` calls, and checkpoints of the
  free-queue order and every running request's block tables.
* :class:`Replayer` applies those records to a kvpool ``KVCacheManager`` and
  raises :class:`Divergence` at the first decision that differs.

``tests/test_vllm_parity.py`` connects the two directly (vLLM installed);
``benchmarks/record_vllm_decisions.py`` writes the records to
``tests/fixtures/vllm/*.jsonl.gz`` and ``tests/test_vllm_recorded.py`` replays
them on every run, with neither vLLM nor torch installed.

Regenerating the fixtures (after changing this module's traffic or the
scenario list), in a separate virtual environment that has vLLM::

    python3 -m venv /work/venv-vllm
    /work/venv-vllm/bin/pip install torch==2.13.0
    /work/venv-vllm/bin/pip install --no-deps vllm==0.33.0   # + the modules vllm.v1.core imports
    /work/venv-vllm/bin/pip install -e ".[test,fast]"
    /work/venv-vllm/bin/python benchmarks/record_vllm_decisions.py

The driver obeys the rules kvpool enforces on its callers: a lookup's hit is
passed straight to ``allocate_slots`` for the same request object;
``num_computed_tokens`` is set to exactly the tokens allocated after a
successful step and back to 0 only after ``free``; a request's prompt, salt
and LoRA never change; and ``max_model_len`` is far beyond any request.

This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "MAX_MODEL_LEN",
    "Divergence",
    "Reference",
    "Replayer",
    "Scenario",
    "build_kvpool_manager",
    "generate",
    "recorded_scenarios",
]

MAX_MODEL_LEN = 1 << 20
"""Far beyond any request the driver makes, so the cap never applies."""

GroupKind = tuple[str, int, int | None]  # ("full", block_size, None) | ("sw", bs, window) | ("cl", bs, chunk)


# -- scenarios --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """Everything that fixes one traffic run: the pool, the layer groups and the mix of operations."""

    name: str
    seed: int
    num_blocks: int
    groups: tuple[GroupKind, ...]
    steps: int = 300
    vocab: int = 50
    num_prefixes: int = 4
    prefix_len: tuple[int, int] = (1, 40)  # shared prefixes' lengths
    suffix_len: tuple[int, int] = (1, 16)  # each prompt's own tokens after its piece of a prefix
    salts: tuple[str | None, ...] = (None,)  # tenants; a prompt picks one at random
    chunk: int = 0  # 0: whole prompts in one step; n: prefill chunks of n//2 .. n tokens
    max_lookahead: int = 0  # speculative slots per step: 0 .. max_lookahead
    # Relative weights of the operations (an operation that cannot run is left out).
    w_admit: float = 0.30
    w_readmit: float = 0.10
    w_step: float = 0.45
    w_finish: float = 0.10
    w_preempt: float = 0.04
    w_reset: float = 0.01
    w_drain: float = 0.005  # preempt everything, then reset_prefix_cache (accepted)
    max_refusals: int = 3  # a waiting request refused this often is dropped
    checkpoint_every: int = 25  # free queue and block tables every n operations (and at the end)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        values = dict(data)
        values["groups"] = tuple((k, int(bs), p) for k, bs, p in values["groups"])
        for key in ("prefix_len", "suffix_len", "salts"):
            values[key] = tuple(values[key])
        return cls(**values)


def _single(family: str, index: int, *, tight: bool) -> Scenario:
    rng = random.Random(f"{family}/{index}")
    block_size = (1, 2, 4, 16)[index % 4]
    per_prompt = 56 // block_size + 2  # blocks of the longest prompt
    if tight:
        num_blocks = rng.randint(per_prompt + 1, 2 * per_prompt + 4)
    else:
        num_blocks = rng.randint(max(per_prompt + 1, 12), 90)
    return Scenario(
        name=f"{family}-{index:02d}",
        seed=rng.randrange(1 << 30),
        num_blocks=num_blocks,
        groups=(("full", block_size, None),),
        steps=300,
        vocab=rng.choice((8, 20, 50)),
        salts=rng.choice(((None,), (None, "tenant-a"), (None, "tenant-a", "tenant-b"))),
        chunk=rng.choice((0, 0, 8, 24)),
        max_lookahead=rng.choice((0, 0, 3)),
        w_preempt=0.08 if tight else 0.04,
        checkpoint_every=5,
    )


def _large(index: int) -> Scenario:
    rng = random.Random(f"single-large/{index}")
    return Scenario(
        name=f"single-large-{index:02d}",
        seed=rng.randrange(1 << 30),
        num_blocks=rng.choice((160, 400)),
        groups=(("full", 16, None),),
        steps=800,
        vocab=1000,
        num_prefixes=6,
        prefix_len=(100, 600),
        suffix_len=(10, 200),
        salts=(None, "tenant-a", "tenant-b"),
        chunk=rng.choice((0, 256)),
        max_lookahead=rng.choice((0, 4)),
        checkpoint_every=20,
    )


def _hybrid(family: str, index: int, *, mixed_sizes: bool, tight: bool) -> Scenario:
    rng = random.Random(f"{family}/{index}")
    base = rng.choice((1, 2, 4))
    groups: list[GroupKind] = []
    for _ in range(rng.choice((2, 2, 3))):
        kind = rng.choice(("full", "sw", "sw") + (() if mixed_sizes else ("cl",)))
        block_size = base * (rng.choice((1, 2, 3)) if mixed_sizes else 1)
        parameter = rng.randint(1, 20) if kind == "sw" else (base * rng.randint(1, 5) if kind == "cl" else None)
        groups.append((kind, block_size, parameter))
    if len({g[0] for g in groups}) == 1 and rng.random() < 0.5:
        groups[0] = ("full", groups[0][1], None)  # mostly mixed kinds
    per_prompt = sum(56 // g[1] + 2 for g in groups)  # blocks of the longest prompt, all groups
    if tight:
        num_blocks = rng.randint(per_prompt // 2 + 1, per_prompt + 8)
    else:
        num_blocks = rng.randint(per_prompt + 1, 2 * per_prompt + 20)
    return Scenario(
        name=f"{family}-{index:02d}",
        seed=rng.randrange(1 << 30),
        num_blocks=num_blocks,
        groups=tuple(groups),
        steps=250,
        vocab=rng.choice((8, 20)),
        salts=rng.choice(((None,), (None, "tenant-a"), ("tenant-a", "tenant-b", "tenant-c"))),
        chunk=rng.choice((0, 0, 8, 24)),
        max_lookahead=rng.choice((0, 0, 3)),
        w_preempt=0.08 if tight else 0.04,
        checkpoint_every=5,
    )


def recorded_scenarios() -> list[Scenario]:
    """The scenarios recorded under tests/fixtures/vllm/ (one fixture file per family)."""
    out = [_single("single", i, tight=False) for i in range(16)]
    out += [_single("single-tight", i, tight=True) for i in range(12)]
    out += [_large(i) for i in range(2)]
    out += [_hybrid("hybrid-equal", i, mixed_sizes=False, tight=False) for i in range(14)]
    out += [_hybrid("hybrid-mixed", i, mixed_sizes=True, tight=False) for i in range(14)]
    out += [_hybrid("hybrid-tight", i, mixed_sizes=i % 2 == 1, tight=True) for i in range(10)]
    return out


def family_of(scenario: Scenario) -> str:
    """The fixture file a scenario is recorded in: its name without the index."""
    return scenario.name.rsplit("-", 1)[0]


# -- the driver ---------------------------------------------------------------------------------


class Reference(Protocol):
    """The calls :func:`generate` makes on the reference manager and its requests."""

    def make_request(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> Any: ...
    def lookup(self, request: Any) -> tuple[Any, int, list[list[int]]]: ...
    def allocate(
        self, request: Any, num_new: int, num_hit: int, hit: Any, lookahead: int
    ) -> list[list[int]] | None: ...
    def num_tokens(self, request: Any) -> int: ...
    def num_computed(self, request: Any) -> int: ...
    def set_computed(self, request: Any, value: int) -> None: ...
    def append(self, request: Any, token: int) -> None: ...
    def mark_preempted(self, request: Any) -> None: ...
    def free(self, request: Any) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def free_queue(self) -> list[int]: ...
    def block_table(self, request_id: str) -> list[list[int]]: ...


def generate(sc: Scenario, ref: Reference) -> Iterator[dict[str, Any]]:
    """Drive ``ref`` through the scenario's traffic; yield one record per operation with ref's decisions.

    The operations depend only on the seed and on the reference's answers, so a
    replay against a manager that answers identically reproduces them. The
    checkpoint interval does not consume random numbers: changing it changes
    which checkpoints are recorded, not the traffic.
    """
    rng = random.Random(sc.seed)
    prefixes = [[rng.randrange(sc.vocab) for _ in range(rng.randint(*sc.prefix_len))] for _ in range(sc.num_prefixes)]
    handles: dict[str, Any] = {}
    running: dict[str, Any] = {}  # admission order
    waiting: deque[str] = deque()  # refused or preempted; re-admitted first in, first out
    refusals: dict[str, int] = {}
    counter = 0

    def chunk_of(remaining: int) -> int:
        if not sc.chunk:
            return remaining
        return min(remaining, rng.randint(max(1, sc.chunk // 2), sc.chunk))

    def lookahead() -> int:
        return rng.randint(0, sc.max_lookahead) if sc.max_lookahead else 0

    def admit(rid: str, record: dict[str, Any]) -> Iterator[dict[str, Any]]:
        request = handles[rid]
        hit, num_hit, hit_ids = ref.lookup(request)
        num_new = chunk_of(ref.num_tokens(request) - num_hit)
        extra = lookahead()
        new = ref.allocate(request, num_new, num_hit, hit, extra)
        record.update(hit=num_hit, hit_blocks=hit_ids, num_new=num_new, lookahead=extra, new=new)
        yield record
        if new is None:
            refusals[rid] = refusals.get(rid, 0) + 1
            if refusals[rid] >= sc.max_refusals:
                del handles[rid]
                yield {"op": "drop", "rid": rid}
            else:
                waiting.append(rid)
        else:
            ref.set_computed(request, num_hit + num_new)
            running[rid] = request

    def preempt(rid: str) -> dict[str, Any]:
        request = running.pop(rid)
        ref.free(request)
        ref.set_computed(request, 0)
        ref.mark_preempted(request)
        waiting.append(rid)
        return {"op": "preempt", "rid": rid}

    def checkpoint() -> dict[str, Any]:
        return {
            "op": "check",
            "free": ref.free_queue(),
            "tables": {rid: ref.block_table(rid) for rid in running},
        }

    for step in range(sc.steps):
        names, weights = ["admit"], [sc.w_admit]
        if waiting:
            names.append("readmit")
            weights.append(sc.w_readmit)
        if running:
            names += ["step", "finish", "preempt", "drain"]
            weights += [sc.w_step, sc.w_finish, sc.w_preempt, sc.w_drain]
        names.append("reset")
        weights.append(sc.w_reset)
        op = rng.choices(names, weights)[0]

        if op == "admit":
            rid = f"r{counter}"
            counter += 1
            tokens = rng.choice(prefixes)[: rng.randint(0, sc.prefix_len[1])]
            tokens += [rng.randrange(sc.vocab) for _ in range(rng.randint(*sc.suffix_len))]
            salt = rng.choice(sc.salts)
            handles[rid] = ref.make_request(rid, tokens, salt)
            yield from admit(rid, {"op": "admit", "rid": rid, "tokens": tokens, "salt": salt})
        elif op == "readmit":
            rid = waiting.popleft()
            yield from admit(rid, {"op": "readmit", "rid": rid})
        elif op == "step":
            rid = rng.choice(list(running))
            request = running[rid]
            computed, total = ref.num_computed(request), ref.num_tokens(request)
            token = None
            if computed < total:  # the prompt's next chunk
                num_new = chunk_of(total - computed)
            else:  # a decode step: the token sampled last step is computed now
                token = rng.randrange(sc.vocab)
                ref.append(request, token)
                num_new = 1
            extra = lookahead()
            new = ref.allocate(request, num_new, 0, None, extra)
            yield {"op": "step", "rid": rid, "append": token, "num_new": num_new, "lookahead": extra, "new": new}
            if new is None:
                yield preempt(rid)
            else:
                ref.set_computed(request, computed + num_new)
        elif op == "finish":
            rid = rng.choice(list(running))
            ref.free(running.pop(rid))
            del handles[rid]
            yield {"op": "free", "rid": rid}
        elif op == "preempt":
            yield preempt(rng.choice(list(running)))
        elif op == "drain":
            for rid in reversed(list(running)):  # newest first, as a scheduler preempts
                yield preempt(rid)
            yield {"op": "reset", "ok": ref.reset_prefix_cache()}
        else:
            yield {"op": "reset", "ok": ref.reset_prefix_cache()}
        if (step + 1) % sc.checkpoint_every == 0:
            yield checkpoint()

    yield checkpoint()
    for rid in list(running):  # finish everything: the free queue then holds every block
        ref.free(running.pop(rid))
        yield {"op": "free", "rid": rid}
    yield checkpoint()


# -- the replay ---------------------------------------------------------------------------------


class Divergence(AssertionError):
    """kvpool decided differently from the recorded reference."""


def build_kvpool_manager(groups: Sequence[GroupKind], num_blocks: int, max_model_len: int = MAX_MODEL_LEN):
    """kvpool's manager for the driver's layer groups (one full-attention group: the plain constructor)."""
    from kvpool import KVCacheManager
    from kvpool.specs import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroup,
        KVDtype,
        SlidingWindowSpec,
    )

    if len(groups) == 1 and groups[0][0] == "full":
        return KVCacheManager(num_blocks, groups[0][1], max_model_len=max_model_len)
    specs = []
    for i, (kind, block_size, parameter) in enumerate(groups):
        common = {"block_size": block_size, "num_kv_heads": 1, "head_dim": 1, "dtype": KVDtype.FP32}
        if kind == "full":
            spec = FullAttentionSpec(**common)
        elif kind == "sw":
            spec = SlidingWindowSpec(sliding_window=parameter, **common)
        elif kind == "cl":
            spec = ChunkedLocalAttentionSpec(attention_chunk_size=parameter, **common)
        else:
            raise ValueError(f"unknown group kind {kind!r}")
        specs.append(KVCacheGroup(spec=spec, layer_ids=(i,)))
    return KVCacheManager.from_groups(specs, num_blocks, max_model_len=max_model_len)


def _as_lists(block_ids) -> list[list[int]] | None:
    return None if block_ids is None else [list(ids) for ids in block_ids]


@dataclass
class Replayer:
    """Applies driver records to a kvpool manager and checks every decision against them."""

    scenario: Scenario
    check_invariants: bool = True
    manager: Any = None
    requests: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    decisions: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=6))

    def __post_init__(self) -> None:
        if self.manager is None:
            self.manager = build_kvpool_manager(self.scenario.groups, self.scenario.num_blocks)

    def replay(self, records) -> int:
        """Apply every record; the number of decisions compared."""
        for record in records:
            self.apply(record)
        return self.decisions

    # -- checking -------------------------------------------------------------------------

    def _fail(self, record: dict[str, Any], what: str, expected: Any, got: Any) -> None:
        context = "\n".join(f"    #{i}: {_short(r)}" for i, r in self.recent)
        rid = record.get("rid")
        state = ""
        if rid in self.requests:
            req = self.requests[rid]
            state = (
                f"\n  request {rid!r}: {req.num_tokens} tokens ({req.num_prompt_tokens} prompt), "
                f"{req.num_computed_tokens} computed, salt={req.cache_salt!r}, "
                f"block table {_as_lists(self.manager.get_block_ids(rid))}"
            )
        raise Divergence(
            f"scenario {self.scenario.name!r} (seed {self.scenario.seed}, groups {list(self.scenario.groups)}, "
            f"{self.scenario.num_blocks} blocks), op #{self.index} {_short(record)}:\n"
            f"  {what}: vLLM {expected!r}, kvpool {got!r}{state}\n"
            f"  free blocks now: {self.manager.num_free_blocks}\n"
            f"  preceding ops:\n{context}"
        )

    def _same(self, record: dict[str, Any], what: str, expected: Any, got: Any) -> None:
        self.decisions += 1
        if expected != got:
            self._fail(record, what, expected, got)

    # -- operations -----------------------------------------------------------------------

    def apply(self, record: dict[str, Any]) -> None:
        from kvpool import CapacityError, Request

        op = record["op"]
        mgr = self.manager
        if op in ("admit", "readmit"):
            rid = record["rid"]
            if op == "admit":
                request = Request(rid, record["tokens"], cache_salt=record["salt"])
                self.requests[rid] = request
            else:
                request = self.requests[rid]
            hit, num_hit = mgr.get_computed_blocks(request)
            self._same(record, "prefix hit tokens", record["hit"], num_hit)
            self._same(record, "prefix hit block IDs", record["hit_blocks"], _as_lists(hit.block_ids))
            try:
                new = mgr.allocate_slots(request, record["num_new"], num_hit, hit, record["lookahead"])
            except CapacityError:  # never fits, even alone: vLLM answers None
                new = None
            self._same(record, "new block IDs", record["new"], _as_lists(new))
            if new is not None:
                request.num_computed_tokens = num_hit + record["num_new"]
        elif op == "step":
            request = self.requests[record["rid"]]
            if record["append"] is not None:
                request.append_output_token_ids(record["append"])
            try:
                new = mgr.allocate_slots(request, record["num_new"], num_lookahead_tokens=record["lookahead"])
            except CapacityError:
                new = None
            self._same(record, "new block IDs", record["new"], _as_lists(new))
            if new is not None:
                request.num_computed_tokens += record["num_new"]
        elif op == "preempt":
            request = self.requests[record["rid"]]
            mgr.free(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
        elif op == "free":
            mgr.free(self.requests.pop(record["rid"]))
        elif op == "drop":
            del self.requests[record["rid"]]
        elif op == "reset":
            self._same(record, "reset_prefix_cache()", record["ok"], mgr.reset_prefix_cache())
        elif op == "check":
            got = mgr.free_queue_block_ids()
            if got != record["free"]:
                first = next(
                    (i for i, (a, b) in enumerate(zip(record["free"], got)) if a != b),
                    min(len(got), len(record["free"])),
                )
                self._fail(
                    record,
                    f"free queue (length {len(record['free'])} vs {len(got)}; first difference at position {first})",
                    record["free"][first : first + 8],
                    got[first : first + 8],
                )
            self.decisions += 1
            for rid, table in record["tables"].items():
                self._same(record, f"block table of {rid!r}", table, _as_lists(mgr.get_block_ids(rid)))
            if self.check_invariants:
                mgr.check_invariants()
        else:
            raise ValueError(f"unknown record {record!r}")
        self.recent.append((self.index, record))
        self.index += 1


def _short(record: dict[str, Any]) -> str:
    shown = {k: v for k, v in record.items() if k not in ("tokens", "free", "tables")}
    if "tokens" in record:
        shown["tokens"] = f"<{len(record['tokens'])} tokens>"
    if "free" in record:
        shown["free"] = f"<{len(record['free'])} blocks>"
        shown["running"] = sorted(record["tables"])
    return repr(shown)
