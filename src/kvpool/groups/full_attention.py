"""Full attention: every token attends to every earlier token.

The group keeps every block of a request until it finishes, and a prefix hit
walks the block hashes from the first block and stops at the first miss.
These are the defaults of :class:`GroupManager`; MLA layers follow the same
rules (one latent per token instead of K and V changes only the bytes).
"""

from __future__ import annotations

from kvpool.groups.base import GroupManager

__all__ = ["FullAttentionManager"]


class FullAttentionManager(GroupManager):
    """Keeps every block; hits are prefixes from the first block."""
