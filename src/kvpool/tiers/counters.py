"""What a tier store counts, and the one way it turns a stored entry into a payload or a counted miss."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace

from kvpool.tiers.entry import CorruptEntry, CorruptKind, EntryCodec

__all__ = ["StoreCounters", "TierStats"]


@dataclass(slots=True)
class TierStats:
    """Counters of one store since it was opened (a snapshot: stores hand out copies).

    ``hits``/``misses``: blocks ``get_many`` returned or did not (a corrupt entry is also a miss);
    ``corrupt``: entries refused by the codec, by kind in ``corrupt_by_kind``; ``errors``: backend
    faults (a full disk, Redis down or timing out), each costing misses or unsaved blocks;
    ``bytes_read``/``bytes_written``: entry bytes moved; ``evictions``: entries the store removed
    to stay within its size (0 for Redis, which evicts by its own policy); ``removed``: refused
    entries the store deleted so that their blocks can be saved again (disk and Redis).
    """

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    removed: int = 0
    corrupt_by_kind: dict[str, int] = field(default_factory=dict)

    def copy(self) -> TierStats:
        return replace(self, corrupt_by_kind=dict(self.corrupt_by_kind))


class StoreCounters:
    """A store's counters and its warnings, each kind of trouble logged once. Thread-safe.

    Entries are verified outside its lock, so threads reading one store check checksums in parallel.
    """

    def __init__(self, name: str, codec: EntryCodec, logger: logging.Logger) -> None:
        self.name = name
        self.codec = codec
        self._stats = TierStats()
        self._logger = logger
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def snapshot(self) -> TierStats:
        with self._lock:
            return self._stats.copy()

    def add(
        self, *, misses: int = 0, errors: int = 0, bytes_written: int = 0, evictions: int = 0, removed: int = 0
    ) -> None:
        with self._lock:
            self._stats.removed += removed
            self._stats.misses += misses
            self._stats.errors += errors
            self._stats.bytes_written += bytes_written
            self._stats.evictions += evictions

    def warn_once(self, kind: str, message: str) -> None:
        """Log ``message`` at WARNING the first time ``kind`` happens in this store, at DEBUG after that."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        self._logger.log(logging.WARNING if first else logging.DEBUG, "kvpool %s tier: %s", self.name, message)

    def forget_warning(self, kind: str) -> None:
        """Let ``kind`` warn again (a backend that recovered and may fail anew)."""
        with self._lock:
            self._warned.discard(kind)

    def error(self, kind: str, message: str, *, misses: int = 0) -> None:
        """A backend fault: counted, and warned about once per kind."""
        self.add(errors=1, misses=misses)
        self.warn_once(kind, message)

    def payload(self, key: bytes, data: bytes | None) -> bytes | None:
        """The verified payload of a stored entry, or None (a miss; a corrupt entry is counted and logged)."""
        if data is None:
            self.add(misses=1)
            return None
        try:
            payload = self.codec.decode(key, data)
        except CorruptEntry as exc:
            self.refused(key, exc)
            return None
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += len(data)
        return payload

    def hit(self, entry_bytes: int) -> None:
        """An entry of ``entry_bytes`` read and verified (by a store that decoded it itself)."""
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += entry_bytes

    def refused(self, key: bytes, exc: CorruptEntry) -> None:
        """An entry under ``key`` that must not be used (a miss): counted by kind, logged once per kind."""
        self._corrupt(exc.kind, f"refused an entry under {key.hex()[:16]}: {exc}")

    def _corrupt(self, kind: CorruptKind, message: str) -> None:
        with self._lock:
            self._stats.misses += 1
            self._stats.corrupt += 1
            self._stats.corrupt_by_kind[kind.value] = self._stats.corrupt_by_kind.get(kind.value, 0) + 1
        self.warn_once(f"corrupt/{kind.value}", message)
