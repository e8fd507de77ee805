"""A directory of KV blocks, bounded in bytes, evicted least recently used, valid across restarts.

Layout: one file per block, ``DIR/<layout namespace>/<hash[:2]>/<hash>.kv``, holding one entry
(:mod:`kvpool.tiers.entry`). One file per block rather than per run keeps eviction, recency and
validity at the granularity the prefix cache works in: a run never has to be split or rewritten
when its tail is evicted, and a lookup stops at the first missing block as it does in GPU memory.
The layout namespace keeps models that share a directory apart (their block hashes may be equal).

Writes are atomic: the entry goes to a temporary file in the same directory, then
``os.replace`` puts it in place, so a reader (this process or another) sees a whole entry or
none. By default nothing is fsynced: a block is a cache of what can be recomputed, and an entry
torn by a power loss fails its length or checksum check and is a counted miss (then deleted).
``fsync=True`` syncs each file before the rename, for filesystems that reorder worse than that.

Recency lives in memory (an ordered dict: O(1) per touch and per eviction) and in each file's
mtime, touched on every hit, so a store opened later on the same directory scans it and
starts with the same LRU order (to the filesystem's timestamp resolution; ties go by key). The size bound counts entry bytes.

Several processes may share a directory: each file appears whole or not at all, a file another
process evicted is a miss, and a file another process wrote is found by its name and adopted.
Each process bounds the bytes it knows of, so the directory stays within the size times the
number of processes at worst, and within the size when they share their blocks.

A write that fails (a full disk, ``ENOSPC``, or any ``OSError``) is counted, warned about once,
and pauses saving for ``retry_after_s``; loads go on.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpool.checks import check_int
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.tiers.counters import StoreCounters, TierStats
from kvpool.tiers.entry import EntryCodec, Payload

__all__ = ["DiskStore"]

_log = logging.getLogger("kvpool.tiers.disk")
_SUFFIX = ".kv"
_STALE_TEMP_S = 3600.0  # a temporary file this old belongs to a writer that died


class DiskStore:
    """Blocks in files under ``directory``, at most ``capacity_bytes`` of entries. Thread-safe."""

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        codec: EntryCodec,
        *,
        fsync: bool = False,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_int("capacity_bytes", capacity_bytes)
        self.root = Path(directory) / codec.namespace
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"disk tier directory {str(directory)!r} cannot be used: {exc}") from exc
        self.capacity_bytes = capacity_bytes
        self._codec = codec
        self._fsync = fsync
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._counters = StoreCounters(self.name, codec, _log)
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> entry bytes, least recent first
        self._used = 0
        self._saves_paused_until = float("-inf")
        self._scan()

    # -- the BlockStore contract ------------------------------------------------------------

    @property
    def stats(self) -> TierStats:
        return self._counters.snapshot()

    @property
    def used_bytes(self) -> int:
        """Entry bytes this store knows of in its directory (at most ``capacity_bytes``)."""
        return self._used

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self._lru and not self._adopt(key):
                break
            count += 1
        return count

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._get(key) for key in keys]

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> int:
        stored = 0
        for key, payload in items:
            if key in self._lru:
                with self._lock:
                    if key in self._lru:
                        self._lru.move_to_end(key)
                stored += 1
                continue
            if self._clock() < self._saves_paused_until:
                continue
            if self._put(key, self._codec.encode(key, payload)):
                stored += 1
        return stored

    def close(self) -> None:
        """Nothing to release: every entry is already a whole file, for this process or the next."""

    def keys_by_recency(self) -> list[bytes]:
        """The keys this store knows of, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._lru)

    def check_invariants(self) -> None:
        """Raise InvariantViolation unless the byte count, the bound and the files agree with the index.

        For tests and debugging; it stats every file, and assumes no other process shares the directory.
        """
        with self._lock:
            sizes = dict(self._lru)
            used = self._used
        if used != sum(sizes.values()) or used > self.capacity_bytes:
            raise InvariantViolation(f"disk tier counts {used} bytes of {self.capacity_bytes}, index holds {sizes}")
        on_disk = {bytes.fromhex(p.stem): p.stat().st_size for p in self.root.glob(f"*/*{_SUFFIX}")}
        if on_disk != sizes:
            raise InvariantViolation(f"disk tier index {sizes} disagrees with its files {on_disk}")

    # -- internals --------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    def _scan(self) -> None:
        """Index the entries already in the directory, oldest mtime first; drop dead writers' temp files."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for path in self.root.glob("*/*"):
            try:
                st = path.stat()
                if path.name.endswith(".tmp"):
                    if now - st.st_mtime > _STALE_TEMP_S:
                        path.unlink()
                    continue
                if path.suffix == _SUFFIX:
                    found.append((st.st_mtime, bytes.fromhex(path.stem), st.st_size))
            except (OSError, ValueError):  # vanished under us, or not one of ours
                continue
        for _mtime, key, size in sorted(found):
            self._lru[key] = size
            self._used += size
        with self._lock:
            self._evict_to(self.capacity_bytes)

    def _adopt(self, key: bytes) -> bool:
        """Index an entry another process wrote, if its file is there."""
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._lru:
                self._lru[key] = size
                self._used += size
                self._evict_to(self.capacity_bytes)
        return key in self._lru

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._used -= size

    def _get(self, key: bytes) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            data = None
        except OSError as exc:
            self._counters.error("read", f"cannot read {path}: {exc}; a miss", misses=1)
            return None
        payload = self._counters.payload(key, data)
        if data is None:
            return None
        if payload is None:  # a refused entry never gets better: remove it
            self._forget(key)
            self._unlink(path)
            return None
        try:
            os.utime(path)  # recency that survives a restart
        except OSError:
            pass
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
            else:
                self._lru[key] = len(data)
                self._used += len(data)
                self._evict_to(self.capacity_bytes)
        return payload

    def _put(self, key: bytes, entry: bytes) -> bool:
        if len(entry) > self.capacity_bytes:
            self._counters.warn_once("too big", f"a {len(entry)}-byte entry exceeds the tier ({self.capacity_bytes})")
            return False
        path = self._path(key)
        with self._lock:
            self._evict_to(self.capacity_bytes - len(entry))
            self._lru[key] = len(entry)  # reserve its room before writing, so concurrent puts stay in bounds
            self._used += len(entry)
        try:
            self._write(path, entry)
        except OSError as exc:
            self._forget(key)
            self._saves_paused_until = self._clock() + self._retry_after_s
            self._counters.error(
                "write", f"cannot write {path}: {exc}; saves pause for {self._retry_after_s:g}s, loads go on"
            )
            return False
        self._counters.add(bytes_written=len(entry))
        if self._saves_paused_until > float("-inf"):  # the first save after a failed one
            self._saves_paused_until = float("-inf")
            self._counters.forget_warning("write")
            _log.warning("kvpool disk tier: saves to %s work again", self.root)
        return True

    def _write(self, path: Path, entry: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(entry)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            self._unlink(Path(tmp))
            raise

    def _evict_to(self, budget: int) -> None:
        """Remove least recently used entries until at most ``budget`` bytes remain. Caller holds the lock."""
        while self._used > budget and self._lru:
            key, size = self._lru.popitem(last=False)
            self._used -= size
            self._counters.add(evictions=1)
            self._unlink(self._path(key))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:  # already gone (another process evicted it), or unwritable: nothing to free
            pass
