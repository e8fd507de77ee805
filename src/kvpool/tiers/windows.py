"""KV tiers for hybrid models: what names a group's entries, which of its blocks a tier holds, the common hit.

A hybrid model (gemma-2, gemma-3, gpt-oss) has full-attention groups and
sliding-window groups sharing one pool (:mod:`kvpool.coordinator`). Tiers
serve such a model under three rules, all here, torch-free and keyed by block
hashes:

**What names an entry** (:meth:`TierGroup.key`). Two groups hold different
layers' KV for the same tokens, under the same chained block hash; the pool
keeps one prefix index per group. A tier has one key space, so a group's key
is the block hash followed by the group's *tag*: eight bytes of BLAKE2b over
the group's position, layer kind, block size, window, KV heads, head size,
dtype and, when given, its layer IDs (:func:`group_tag`). Two groups never share a tag, so
they never read each other's bytes; two processes of the same model compute
the same tags. A model of one full-attention group has no tag: its keys are
the block hashes, as before hybrid support, so existing tiers keep their
entries.

**The common hit** (:func:`common_hit`): the device cache's rule, the
coordinator's fixed point, over the union of the pool's local hit and the
tiers. After a local hit of ``first`` blocks (every group agreed on it), a
full-attention group needs every next block from a tier, a window group
only the ``blocks_for_hit`` blocks before the hit's end (vLLM's sliding-window
``find_longest_cache_hit``): its blocks before ``first`` are in the pool's
hit, and a run reaching block 0 is enough. The hit is the longest end every
group accepts::

    block size 4, window 8 (a hit needs 2 window blocks before its end), local hit 0

    block        0   1   2   3   4   5
    full in a    y   y   y   y   y   y      -> full attention accepts 6
    window in a  -   -   y   y   -   y      -> ends 6 (block 4 missing) and 5 fail;
                                               the run 2..3 ends at 4: window accepts 4
    full         trimmed to 4                -> the hit is 4 blocks (16 tokens)

    loads: full blocks 0..3, window blocks 2..3 (blocks 0, 1 fell out of the window)

Each looked-up block comes from the first tier, in the configured order,
that holds it (:meth:`~kvpool.tiers.policy.TierPolicy.match`).

**What a window group saves** (:func:`first_readable`): a block the request
can still read when it is saved, the same rule by which the pool gives a
window block back. A block that fell out of the window in the step that
filled it (a long prefill chunk) is skipped: no hit can read it without
blocks after it, which the tier then holds anyway. A prompt of ``P`` tokens
prefilled in one step saves ``P // bs - (P - window + 1) // bs`` blocks per
window group, at most ``cdiv(window - 1, bs) + 1`` (the planner's blocks per
request, :meth:`kvpool.specs.SlidingWindowSpec.blocks_per_request`), where a
full-attention group saves ``P // bs``.

Groups that cannot be served (Mamba states, chunked-local and cross attention)
are refused with a :class:`~kvpool.errors.ConfigError` naming the kind, as are
groups whose block size is not the manager's (hits would need an alignment
the tiers do not keep).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.errors import ConfigError
from kvpool.groups.base import GroupManager
from kvpool.groups.full_attention import FullAttentionManager
from kvpool.groups.sliding_window import SlidingWindowManager
from kvpool.manager import KVCacheManager

__all__ = ["TierGroup", "common_hit", "first_readable", "group_tag", "tier_groups"]

_TAG_BYTES = 8
_TAG_DOMAIN = b"kvpool-tier-group-v1"


def group_tag(group: GroupManager, layer_ids: Sequence[int] | None = None) -> bytes:
    """Eight bytes naming ``group``'s layer spec and position among the model's groups (see the module).

    ``layer_ids``: the group's layers, when known (a manager built from
    :func:`kvpool.specs.group_layers` does not keep them; position and spec
    then name the group, which is unique within one model).
    """
    spec = group.spec
    fields = [
        _TAG_DOMAIN,
        str(group.group_id).encode(),
        spec.kind.value.encode(),
        str(spec.block_size).encode(),
        str(getattr(spec, "sliding_window", None)).encode(),
        str(getattr(spec, "num_kv_heads", None)).encode(),
        str(getattr(spec, "head_dim", None)).encode(),
        str(getattr(getattr(spec, "dtype", None), "value", None)).encode(),
        ",".join(str(i) for i in (layer_ids or ())).encode(),
    ]
    return hashlib.blake2b(b"\x00".join(fields), digest_size=_TAG_BYTES).digest()


@dataclass(frozen=True, slots=True)
class TierGroup:
    """One layer group as the tiers see it.

    ``index``: its position in the manager's groups (its block table);
    ``tag``: appended to the block hash to make its tier key (empty for a
    model of one full-attention group); ``window_blocks``: blocks a hit needs
    before its end, at least one (None: every block, full attention); ``manager``: the
    group's manager, whose ``num_skipped_tokens`` is the window rule.
    """

    index: int
    tag: bytes
    window_blocks: int | None
    manager: GroupManager

    @property
    def is_window(self) -> bool:
        return self.window_blocks is not None

    def key(self, block_hash: bytes) -> bytes:
        """The tier key of this group's block cached under ``block_hash``."""
        return bytes(block_hash) + self.tag


def tier_groups(manager: KVCacheManager, layer_ids: Sequence[Sequence[int]] | None = None) -> tuple[TierGroup, ...]:
    """The manager's groups as tiers serve them; ConfigError naming the first group they cannot serve.

    ``layer_ids``: each group's layers, to go into its tag (optional).
    """
    groups = manager.groups
    if layer_ids is not None and len(layer_ids) != len(groups):
        raise ConfigError(f"layer_ids names {len(layer_ids)} groups, the manager has {len(groups)}")
    single = len(groups) == 1 and type(groups[0]) is FullAttentionManager
    out: list[TierGroup] = []
    for i, group in enumerate(groups):
        kind = group.spec.kind.value
        if type(group) is FullAttentionManager:
            window = None
        elif type(group) is SlidingWindowManager:
            # The pool's search ends a hit at a cached block, so even a one-token window needs one.
            window = max(group.blocks_for_hit, 1)
        else:
            raise ConfigError(
                f"KV tiers serve full-attention and sliding-window layer groups; group {i} is {kind} "
                f"({type(group).__name__}), whose hits the tiers cannot keep"
            )
        if group.block_size != manager.block_size:
            raise ConfigError(
                f"KV tiers need every layer group at the manager's block size {manager.block_size}; "
                f"group {i} ({kind}) has {group.block_size}"
            )
        tag = b"" if single else group_tag(group, None if layer_ids is None else layer_ids[i])
        out.append(TierGroup(i, tag, window, group))
    tags = [g.tag for g in out]
    if len(set(tags)) != len(tags):
        raise ConfigError("two layer groups have the same tier tag (their specs and positions are equal)")
    return tuple(out)


def first_readable(group: TierGroup, num_tokens: int) -> int:
    """The first block of ``group`` a request with ``num_tokens`` computed can still read (0 for full attention).

    The pool's rule (:meth:`GroupManager.num_skipped_tokens`): blocks before it are given back.
    """
    return group.manager.num_skipped_tokens(num_tokens) // group.manager.block_size


#: How many leading keys of a sequence the tiers hold, each from the first tier holding it.
HeldPrefix = Callable[[Sequence[bytes]], int]


def common_hit(
    groups: Sequence[TierGroup], keys: Sequence[Sequence[bytes]], first: int, stop: int, held: HeldPrefix
) -> tuple[int, tuple[int, ...]]:
    """The longest hit end (in blocks, ``first`` to ``stop``) every group accepts, and each group's first block
    to load (``first`` for full attention; the window's start for a window group).

    ``keys[g][k]`` is group ``g``'s tier key of block ``k`` (at least ``stop`` of them); blocks before
    ``first`` are the pool's local hit; ``held(keys)`` answers how many leading keys the tiers hold.
    The device's rule (:mod:`kvpool.coordinator`): lengths only fall, so it ends; full-attention
    groups are looked up once and then trimmed. Changes nothing.
    """
    if stop <= first:
        return first, tuple(first for _ in groups)
    full_ends: dict[int, int] = {}
    end = stop
    while True:
        candidate = end
        for group in groups:  # full attention first: looked up once, then only trimmed
            if group.window_blocks is None:
                if group.index not in full_ends:
                    full_ends[group.index] = first + held(keys[group.index][first:stop])
                candidate = min(candidate, full_ends[group.index])
        for group in groups:
            if group.window_blocks is not None and candidate > first:
                candidate = _window_end(group.window_blocks, keys[group.index], first, candidate, held)
        if candidate >= end:
            break
        end = candidate
    starts = tuple(first if g.window_blocks is None else max(first, end - g.window_blocks) for g in groups)
    return end, starts


def _window_end(need: int, keys: Sequence[bytes], first: int, end: int, held: HeldPrefix) -> int:
    """The latest end at most ``end`` whose ``need`` blocks before it are held (or reach block 0 or ``first``).

    Right to left, as the pool's window search: a missing block rules out every end whose window holds it.
    """
    while end > first:
        start = max(first, end - need)
        found = held(keys[start:end])
        if found >= end - start:
            return end
        end = start + found  # the first missing block: any later end's window would hold it
    return first
