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
and pauses saving for ``retry_after_s``; loads go on. A write that fails because of what sits at
that one entry's path (a directory, a file where a shard directory belongs) costs that entry only.

The directory is not trusted. Every file operation goes through a descriptor of the store's
directory and of the shard directory, opened without following links, so a link planted in place
of a shard or an entry never leads the store elsewhere. An entry is read only if it is a regular
file, opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks the reader) and checked with
``fstat`` on the open descriptor, and only if it is no longer than the longest entry this layout
can have (:meth:`EntryCodec.max_entry_bytes`): a sparse file, a link to ``/dev/zero`` or any
oversized file is refused before a byte is read, and a read never takes more than that bound. A
refused object at an entry's path is removed (a directory there is only forgotten). The index
holds only what the store wrote, or adopted because it is a regular file under an entry's exact
name (lowercase hex, in its shard) within that bound; anything else in the directory is neither
counted nor touched.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvpool.checks import check_int
from kvpool.errors import ConfigError, InvariantViolation
from kvpool.tiers.counters import StoreCounters, TierStats
from kvpool.tiers.entry import CorruptEntry, CorruptKind, EntryCodec, Payload
from kvpool.tiers.kinds import TierBackend, TierKind, parse_size

__all__ = ["BACKEND", "DiskStore", "DiskTarget"]

_log = logging.getLogger("kvpool.tiers.disk")
_SUFFIX = ".kv"
_STALE_TEMP_S = 3600.0  # a temporary file this old belongs to a writer that died
_HEX = frozenset("0123456789abcdef")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What sits at one entry's path, not what the medium can do: such a failed write costs that entry only.
_PATH_ERRNOS = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY, errno.ELOOP})


def _entry_name(key: bytes) -> str:
    return key.hex() + _SUFFIX


def _entry_key(shard: str, name: str) -> bytes | None:
    """The key whose entry is exactly ``shard/name``, or None when the name is not one the store writes."""
    stem = name[: -len(_SUFFIX)]
    if not name.endswith(_SUFFIX) or len(stem) < 2 or len(stem) % 2 or stem[:2] != shard or not _HEX.issuperset(stem):
        return None
    return bytes.fromhex(stem)


@dataclass(frozen=True, slots=True)
class DiskTarget:
    """A disk tier spec, checked: the directory and its bound in bytes."""

    path: str
    capacity_bytes: int

    kind: ClassVar[TierKind] = TierKind.DISK

    @classmethod
    def parse(cls, spec: str) -> DiskTarget:
        """``disk:PATH:SIZE``; ConfigError naming the spec."""
        path, sep, size = spec.removeprefix("disk:").rpartition(":")
        if not sep or not path:
            raise ConfigError(f"disk tier spec {spec!r} must be disk:PATH:SIZE, e.g. disk:/var/cache/kvpool:50GiB")
        return cls(path, parse_size(size, field=f"size in tier spec {spec!r}"))


class DiskStore:
    """Blocks in files under ``directory``, at most ``capacity_bytes`` of entries. Thread-safe."""

    name = TierKind.DISK.value

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
            self._root_fd = os.open(self.root, _DIR_FLAGS)
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

    def get_many_into(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        """Read each key's payload straight into its buffer in ``out`` (no copy between); whether it arrived.

        A buffer the payload does not fill exactly is a miss (the entry is refused); the contents of
        a buffer whose key missed are unspecified.
        """
        if len(out) != len(keys):
            raise ConfigError(f"get_many_into needs one buffer per key, got {len(out)} for {len(keys)} keys")
        return [self._get_into(key, buffer) for key, buffer in zip(keys, out)]

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
            if self._put(key, *self._codec.encode_parts(key, payload)):
                stored += 1
        return stored

    def close(self) -> None:
        """Close the directory's descriptor; every entry is already a whole file, for this process or the next."""
        with self._lock:
            fd, self._root_fd = self._root_fd, -1
        if fd >= 0:
            os.close(fd)

    def keys_by_recency(self) -> list[bytes]:
        """The keys this store knows of, least recently used first (the eviction order)."""
        with self._lock:
            return list(self._lru)

    def check_invariants(self, *, exclusive: bool = True) -> None:
        """Raise InvariantViolation unless the byte count, the bound and the files agree with the index.

        Always: the count is the index's sum and within the bound. With ``exclusive`` (no other
        process, and nothing else, writes the directory), the index is exactly the entry files
        the store would adopt, with their sizes. For tests and debugging; it stats every file.
        """
        with self._lock:
            sizes = dict(self._lru)
            used = self._used
        if used != sum(sizes.values()) or used > self.capacity_bytes:
            raise InvariantViolation(f"disk tier counts {used} bytes of {self.capacity_bytes}, index holds {sizes}")
        if exclusive:
            on_disk = {key: size for _mtime, key, size in self._entries()}
            if on_disk != sizes:
                raise InvariantViolation(f"disk tier index {sizes} disagrees with its files {on_disk}")

    # -- internals --------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        """Where ``key``'s entry lives (for messages; files are reached through directory descriptors)."""
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    @contextmanager
    def _shard(self, key: bytes, *, create: bool = False) -> Iterator[int]:
        """A descriptor of ``key``'s shard directory, never through a link (OSError if it is not a directory)."""
        name = key.hex()[:2]
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except OSError as exc:
            if not create or exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise
            if exc.errno != errno.ENOENT:  # a link or a file where the shard belongs: not ours, in our directory
                os.unlink(name, dir_fd=self._root_fd)
            try:
                os.mkdir(name, dir_fd=self._root_fd)
            except FileExistsError:  # another writer made it first
                pass
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def _cap(self, key: bytes) -> int:
        return self._codec.max_entry_bytes(len(key))

    def _adoptable(self, key: bytes, st: os.stat_result) -> bool:
        """Whether a file's ``lstat`` is one the index may count: a regular file no longer than an entry can be."""
        return stat.S_ISREG(st.st_mode) and st.st_size <= self._cap(key)

    def _entries(self) -> list[tuple[float, bytes, int]]:
        """``(mtime, key, size)`` of every adoptable entry file; dead writers' temporary files are removed."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        with os.scandir(self._root_fd) as shards:
            names = [e.name for e in shards if len(e.name) == 2 and _HEX.issuperset(e.name)]
        for shard in names:
            try:
                fd = os.open(shard, _DIR_FLAGS, dir_fd=self._root_fd)
            except OSError:  # not a directory (a link, a file), or vanished: not ours
                continue
            try:
                with os.scandir(fd) as files:
                    for entry in files:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except OSError:  # vanished under us
                            continue
                        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > _STALE_TEMP_S:
                                self._unlink_at(fd, entry.name)
                            continue
                        key = _entry_key(shard, entry.name)
                        if key is not None and self._adoptable(key, st):
                            found.append((st.st_mtime, key, st.st_size))
            finally:
                os.close(fd)
        return found

    def _scan(self) -> None:
        """Index the entries already in the directory, oldest mtime first."""
        for _mtime, key, size in sorted(self._entries()):
            self._lru[key] = size
            self._used += size
        with self._lock:
            self._evict_to(self.capacity_bytes)

    def _adopt(self, key: bytes) -> bool:
        """Index an entry another process wrote, if an adoptable file is at its path."""
        try:
            with self._shard(key) as fd:
                st = os.stat(_entry_name(key), dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        if not self._adoptable(key, st):
            return False
        with self._lock:
            if key not in self._lru:
                self._lru[key] = st.st_size
                self._used += st.st_size
                self._evict_to(self.capacity_bytes)
        return key in self._lru

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._used -= size

    def _open_entry(self, key: bytes) -> tuple[int, int] | None:
        """An open descriptor of ``key``'s file and its size, if it is a regular file within the entry bound.

        None if there is none; CorruptEntry (NOT_A_FILE, OVERSIZED) when something else is at the
        path; OSError for I/O faults. The caller closes the descriptor.
        """
        cap = self._cap(key)
        try:
            with self._shard(key) as shard:
                try:
                    fd = os.open(_entry_name(key), _READ_FLAGS, dir_fd=shard)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO):  # a link (O_NOFOLLOW), a socket
                        raise CorruptEntry(CorruptKind.NOT_A_FILE, f"cannot be opened as a file: {exc}") from None
                    raise
        except FileNotFoundError:
            return None
        except NotADirectoryError:  # the shard is a link or a file: no entry of ours can be there
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # the shard itself is a link
                return None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptEntry(CorruptKind.NOT_A_FILE, f"file mode {stat.filemode(st.st_mode)}")
            if st.st_size > cap:
                raise CorruptEntry(CorruptKind.OVERSIZED, f"{st.st_size} bytes, an entry is at most {cap}")
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def _read(self, key: bytes) -> bytes | None:
        """The bytes of ``key``'s file if it is a regular file within the entry bound; None if there is none.

        CorruptEntry (NOT_A_FILE, OVERSIZED) when something else is at the path; OSError for I/O faults.
        """
        opened = self._open_entry(key)
        if opened is None:
            return None
        fd, _size = opened
        cap = self._cap(key)
        try:
            chunks: list[bytes] = []
            left = cap + 1  # one byte past the bound tells a file that grew after fstat
            while left > 0:
                chunk = os.read(fd, left)
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > cap:
            raise CorruptEntry(CorruptKind.OVERSIZED, f"grew past {cap} bytes while read")
        return data

    def _read_into(self, key: bytes, out: memoryview) -> int | None:
        """Check ``key``'s entry and read its payload straight into ``out``; the entry's size, None if there is none.

        The head is read first (at most the longest head), checked, then the payload goes into
        ``out`` with one ``preadv`` that asks one byte more (a file that grew after ``fstat``), and
        is verified there. CorruptEntry as :meth:`_read` and :meth:`EntryCodec.decode_into`; OSError
        for I/O faults. ``out`` holds garbage when this raises.
        """
        opened = self._open_entry(key)
        if opened is None:
            return None
        fd, size = opened
        codec = self._codec
        try:
            head_bytes = os.pread(fd, min(size, codec.max_head_bytes(len(key))), 0)
            head = codec.parse_head(key, head_bytes, size)
            if head.payload_len != out.nbytes:
                raise CorruptEntry(CorruptKind.MALFORMED, f"{head.payload_len} payload bytes, a block is {out.nbytes}")
            spare = bytearray(1)
            done = 0
            while done < out.nbytes:
                n = os.preadv(fd, [out[done:], spare], head.size + done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        if done > out.nbytes:
            raise CorruptEntry(CorruptKind.OVERSIZED, f"grew past {size} bytes while read")
        if done < out.nbytes:
            raise CorruptEntry(CorruptKind.TRUNCATED, f"shrank to {head.size + done} bytes while read")
        codec.verify(head, memoryview(head_bytes)[: head.size], out)
        return size

    def _get(self, key: bytes) -> bytes | None:
        try:
            data = self._read(key)
        except CorruptEntry as exc:
            self._counters.refused(key, exc)
            self._discard(key)
            return None
        except OSError as exc:
            self._counters.error("read", f"cannot read {self._path(key)}: {exc}; a miss", misses=1)
            return None
        payload = self._counters.payload(key, data)
        if data is None:
            self._forget(key)
            return None
        if payload is None:  # a refused entry never gets better: remove it
            self._discard(key)
            return None
        self._touch(key, len(data))
        return payload

    def _get_into(self, key: bytes, out: memoryview) -> bool:
        try:
            size = self._read_into(key, out)
        except CorruptEntry as exc:
            self._counters.refused(key, exc)
            self._discard(key)  # a refused entry never gets better: remove it
            return False
        except OSError as exc:
            self._counters.error("read", f"cannot read {self._path(key)}: {exc}; a miss", misses=1)
            return False
        if size is None:
            self._counters.add(misses=1)
            self._forget(key)
            return False
        self._counters.hit(size)
        self._touch(key, size)
        return True

    def _touch(self, key: bytes, size: int) -> None:
        """``key``'s entry of ``size`` bytes was just read: most recently used, here and in its mtime."""
        try:
            with self._shard(key) as shard:
                os.utime(_entry_name(key), dir_fd=shard, follow_symlinks=False)  # recency that survives a restart
        except OSError:
            pass
        with self._lock:
            known = self._lru.get(key)
            if known is not None:
                self._used += size - known  # another writer may have replaced the file
                self._lru[key] = size
                self._lru.move_to_end(key)
            else:
                self._lru[key] = size
                self._used += size
            self._evict_to(self.capacity_bytes)

    def _discard(self, key: bytes) -> None:
        """Forget ``key`` and remove what is at its path (a directory there is left alone)."""
        self._forget(key)
        if self._unlink(key):
            self._counters.add(removed=1)

    def _put(self, key: bytes, head: bytes, body: memoryview) -> bool:
        size = len(head) + body.nbytes
        if size > self.capacity_bytes:
            self._counters.warn_once("too big", f"a {size}-byte entry exceeds the tier ({self.capacity_bytes})")
            return False
        with self._lock:
            self._evict_to(self.capacity_bytes - size)
            self._lru[key] = size  # reserve its room before writing, so concurrent puts stay in bounds
            self._used += size
        try:
            self._write(key, head, body)
        except OSError as exc:
            self._forget(key)
            if exc.errno in _PATH_ERRNOS:
                self._counters.error("entry path", f"cannot write {self._path(key)}: {exc}; that block is not saved")
                return False
            self._saves_paused_until = self._clock() + self._retry_after_s
            self._counters.error(
                "write",
                f"cannot write {self._path(key)}: {exc}; saves pause for {self._retry_after_s:g}s, loads go on",
            )
            return False
        self._counters.add(bytes_written=size)
        if self._saves_paused_until > float("-inf"):  # the first save after a failed one
            self._saves_paused_until = float("-inf")
            self._counters.forget_warning("write")
            _log.warning("kvpool disk tier: saves to %s work again", self.root)
        return True

    def _write(self, key: bytes, head: bytes, body: memoryview) -> None:
        name = _entry_name(key)
        tmp = f".{name[:16]}.{secrets.token_hex(6)}.tmp"
        with self._shard(key, create=True) as shard:
            fd = os.open(tmp, _WRITE_FLAGS, 0o600, dir_fd=shard)
            try:
                try:
                    parts = [memoryview(head), body]  # one writev: the payload is never joined to its head
                    while parts:
                        written = os.writev(fd, parts)
                        while parts and written >= parts[0].nbytes:
                            written -= parts.pop(0).nbytes
                        if parts:
                            parts[0] = parts[0][written:]
                    if self._fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=shard, dst_dir_fd=shard)
            except BaseException:
                self._unlink_at(shard, tmp)
                raise

    def _evict_to(self, budget: int) -> None:
        """Remove least recently used entries until at most ``budget`` bytes remain. Caller holds the lock."""
        while self._used > budget and self._lru:
            key, size = self._lru.popitem(last=False)
            self._used -= size
            self._counters.add(evictions=1)
            self._unlink(key)

    def _unlink(self, key: bytes) -> bool:
        """Remove ``key``'s entry path; whether something was removed."""
        try:
            with self._shard(key) as shard:
                return self._unlink_at(shard, _entry_name(key))
        except OSError:  # no shard (or not a directory): nothing of ours to remove
            return False

    @staticmethod
    def _unlink_at(dir_fd: int, name: str) -> bool:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:  # already gone (another process evicted it), a directory, or unwritable: nothing to free
            return False
        return True


def _open(target: DiskTarget, codec: EntryCodec) -> DiskStore:
    return DiskStore(target.path, target.capacity_bytes, codec)


#: The disk tier, as the registry (:data:`kvpool.tiers.store.BACKENDS`) holds it.
BACKEND = TierBackend(
    kind=TierKind.DISK,
    prefixes=("disk:",),
    parse=DiskTarget.parse,
    open=_open,
    example="disk:PATH:SIZE",
    shared=True,
    outlives_process=True,
    fleet_wide=False,
    link=(4e9, 100e-6),  # a local NVMe drive
    vllm_hit_source="DISK",
    event_medium="STORAGE",  # kvpool.events.MEDIUM_STORAGE: vLLM's name for every tier below host memory
)
