"""One manager per layer type, all drawing blocks from one pool."""

from __future__ import annotations

from types import MappingProxyType

from kvpool.errors import ConfigError
from kvpool.groups.base import GroupManager
from kvpool.groups.chunked_local import ChunkedLocalAttentionManager
from kvpool.groups.cross_attention import CrossAttentionManager
from kvpool.groups.full_attention import FullAttentionManager
from kvpool.groups.mamba import MambaManager
from kvpool.groups.sliding_window import SlidingWindowManager

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "GroupManager",
    "MambaManager",
    "SlidingWindowManager",
    "manager_class_for",
]

_MANAGERS: MappingProxyType[str, type[GroupManager]] = MappingProxyType(
    {
        "FULL_ATTENTION": FullAttentionManager,
        "MLA": FullAttentionManager,
        "SLIDING_WINDOW": SlidingWindowManager,
        "CHUNKED_LOCAL": ChunkedLocalAttentionManager,
        "MAMBA": MambaManager,
        "CROSS_ATTENTION": CrossAttentionManager,
    }
)


def manager_class_for(spec: object) -> type[GroupManager]:
    """The group manager class that applies the rules of ``spec``'s layer type (by ``spec.kind``)."""
    kind = getattr(getattr(spec, "kind", None), "name", None)
    try:
        return _MANAGERS[kind]  # type: ignore[index]  # kind may be None: the KeyError below reports it
    except KeyError:
        raise ConfigError(f"no group manager for layer kind {kind!r} (spec {spec!r})") from None
