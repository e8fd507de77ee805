"""What names a model's weights in KV tier entries: the operator's namespace, or the digest of the model folder.

Entries that outlive the process that wrote them (disk, Redis; the backend registry says which) must
name the weights they were computed with, or two models sharing a tier would read each other's KV.
:func:`tier_weights` is that name, for the engine and the vLLM connector alike: the operator's
``namespace``, else :func:`model_digest`, the SHA-256 of every file in the model folder, each file's
digest remembered in ``<cache root>/file-digests.json`` by the file's identity, so a restart hashes
nothing that did not change. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpool.checks import format_bytes
from kvpool.errors import ConfigError
from kvpool.model_names import cache_root

__all__ = ["DIGEST_CACHE_FILE", "ModelDigest", "model_digest", "tier_weights"]

_log = logging.getLogger("kvpool.tiers")


#: The file under the cache root that remembers model files' SHA-256 by their identity.
DIGEST_CACHE_FILE = "file-digests.json"

_log = logging.getLogger("kvpool.engine")
_DIGEST_CACHE_VERSION = 1
# A file changed this recently could change again within one tick of its timestamps, unseen by
# (size, mtime, ctime, inode): its digest is used but not remembered (git's "racily clean" rule).
_RACY_NS = 2_000_000_000


@dataclass(frozen=True, slots=True)
class ModelDigest:
    """What a model folder holds, as one name, and what it cost to compute.

    Attributes:
        value: ``"sha256:<64 hex>"``, over every file's path in the folder and its SHA-256.
        files: files covered; ``size``: their bytes.
        hashed_files: files read this time (0 when every digest was remembered); ``hashed_bytes``: their bytes.
        seconds: wall time of the whole call.
    """

    value: str
    files: int
    size: int
    hashed_files: int
    hashed_bytes: int
    seconds: float


def _model_files(folder: Path) -> list[tuple[str, Path, os.stat_result]]:
    """``(relative posix path, path, stat)`` of every regular file in ``folder``, sorted; hidden names left out.

    Links to files are followed (a Hugging Face snapshot is links into its blob store); links to
    directories are not, so a link cannot make the walk loop.
    """
    found: list[tuple[str, Path, os.stat_result]] = []
    for here, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.startswith("."):
                continue
            path = Path(here) / name
            try:
                st = path.stat()
            except OSError:  # a dangling link: nothing transformers could load either
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((path.relative_to(folder).as_posix(), path, st))
    found.sort(key=lambda item: item[0])
    return found


def _hash_file(path: Path) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_digest_cache(path: Path) -> dict[str, list[object]]:
    """The remembered digests (absolute path -> identity + hex digest); empty when missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("version") == _DIGEST_CACHE_VERSION else None
    return dict(files) if isinstance(files, dict) else {}


def _write_digest_cache(path: Path, files: dict[str, list[object]]) -> None:
    """Save the remembered digests atomically, dropping files that no longer exist; best effort."""
    kept = {name: entry for name, entry in files.items() if os.path.exists(name)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _DIGEST_CACHE_VERSION, "files": kept}, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache costs the next start a re-hash, nothing else
        _log.debug("cannot remember model file digests in %s: %s", path, exc)


def model_digest(
    folder: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    clock: Callable[[], int] = time.time_ns,
) -> ModelDigest:
    """The digest of every file in the model folder ``folder`` (weights, config, tokenizer, the rest).

    Each file's SHA-256 is remembered in :data:`DIGEST_CACHE_FILE` under the cache root
    (:func:`cache_root`) by the file's absolute path, size, mtime, ctime and inode, and reused
    while all five are unchanged, so only new or changed files are read. A file changed within
    the last two seconds by ``clock`` (nanoseconds since the epoch) is hashed but not remembered.
    Names starting with a dot are left out. O(bytes of the changed files) plus one stat per file.

    Raises:
        ConfigError: ``folder`` is not a directory or holds no file.
    """
    started = time.perf_counter()
    root = Path(folder).expanduser().absolute()
    if not root.is_dir():
        raise ConfigError(f"model folder {str(folder)!r} is not a directory")
    files = _model_files(root)
    if not files:
        raise ConfigError(f"model folder {str(folder)!r} holds no file to identify the model by")
    cache_path = cache_root(cache_dir) / DIGEST_CACHE_FILE
    remembered = _read_digest_cache(cache_path)
    now = clock()
    total = hashlib.sha256(b"kvpool/model-files/v1\0")
    hashed_files = hashed_bytes = 0
    changed = False
    for relative, path, st in files:
        key = str(path)
        identity = _identity(st)
        entry = remembered.get(key)
        if isinstance(entry, list) and entry[:-1] == identity and isinstance(entry[-1], str):
            hexdigest = entry[-1]
        else:
            hexdigest = _hash_file(path)
            hashed_files += 1
            hashed_bytes += st.st_size
            if now - max(st.st_mtime_ns, st.st_ctime_ns) >= _RACY_NS:
                remembered[key] = [*identity, hexdigest]
                changed = True
        total.update(f"{relative}\0{hexdigest}\n".encode())
    if changed:
        _write_digest_cache(cache_path, remembered)
    return ModelDigest(
        value="sha256:" + total.hexdigest(),
        files=len(files),
        size=sum(st.st_size for _, _, st in files),
        hashed_files=hashed_files,
        hashed_bytes=hashed_bytes,
        seconds=time.perf_counter() - started,
    )


def tier_weights(model_folder: str | os.PathLike[str], namespace: str | None, log: Callable[[str], None]) -> str:
    """What names the model's weights in tier entries: the operator's ``namespace``, else the folder's digest."""
    if namespace is not None:
        log(f"KV tier entries name the weights by the namespace {namespace!r} (the model files are not hashed)")
        return f"namespace:{namespace}"
    digest = model_digest(model_folder)
    how = (
        f"hashed {digest.hashed_files} of them ({format_bytes(digest.hashed_bytes)}) in {digest.seconds:.2f} s"
        if digest.hashed_files
        else f"remembered, checked in {digest.seconds * 1000:.1f} ms"
    )
    log(
        f"KV tier entries name the weights {digest.value[:23]}...: {digest.files} files, {format_bytes(digest.size)}; {how}"
    )
    return digest.value
