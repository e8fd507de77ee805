"""One manager per layer type, all drawing blocks from one pool."""

from __future__ import annotations

from kvpool.errors import ConfigError
from kvpool.groups.base import GroupManager
from kvpool.groups.full_attention import FullAttentionManager

__all__ = ["FullAttentionManager", "GroupManager", "manager_class_for"]


def manager_class_for(spec: object) -> type[GroupManager]:
    """The group manager class that applies the rules of ``spec``'s layer type."""
    kind = getattr(getattr(spec, "kind", None), "name", None)
    managers: dict[str, type[GroupManager]] = {
        "FULL_ATTENTION": FullAttentionManager,
        "MLA": FullAttentionManager,
    }
    try:
        return managers[kind]  # type: ignore[index]
    except KeyError:
        raise ConfigError(f"no group manager for layer kind {kind!r} (spec {spec!r})") from None
