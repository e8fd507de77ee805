"""Many emulated replicas in one process: their model folder, their context, their event endpoints.

``kvpool serve --emulate PROFILE --replicas N`` starts N :class:`~kvpool.emulator.EmulatedEngine`
objects, each its own scheduler, pool and HTTP server, sharing one tokenizer (read-only, and
the heaviest thing a replica holds). Replica ``i`` listens on the given port plus ``i`` (port 0:
each binds a free one) and publishes its KV events on the given event ports plus ``i``
(:func:`replica_endpoint`), so every replica's events are a stream of their own, as N vLLM
servers' are.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from kvpool.errors import ConfigError
from kvpool.gguf_tokenizer import tokenizer_folder_for
from kvpool.model_config import load_model_config, max_position_embeddings
from kvpool.model_names import bundled_model, model_folder

__all__ = ["DEFAULT_MAX_MODEL_LEN", "context_length", "replica_endpoint", "replica_port", "tokenizer_folder"]

#: The context of a model whose folder holds a tokenizer but no config.json.
DEFAULT_MAX_MODEL_LEN = 8192
#: A ``model_max_length`` past this is transformers' "no limit known", not a context.
_LONGEST_CONTEXT = 1 << 24

_TCP_PORT = re.compile(r"^(?P<head>(?:bind:|connect:)?tcp://.+:)(?P<port>\d+)$")


def tokenizer_folder(model: str | os.PathLike[str]) -> Path:
    """The folder whose tokenizer an emulated replica of ``model`` uses: a folder holding ``tokenizer.json``
    as it is; for one of kvpool's bundled models, its converted folder or else the tokenizer read from its
    GGUF file (:func:`kvpool.gguf_tokenizer.tokenizer_folder_for`: no torch); else a model folder."""
    folder = Path(model).expanduser()
    if (folder / "tokenizer.json").is_file():
        return folder
    bundled = bundled_model(model)
    if bundled is not None:
        return tokenizer_folder_for(bundled)
    return model_folder(model)


def context_length(folder: Path) -> int:
    """The model's context: its config.json's ``max_position_embeddings``, else the ``model_max_length`` of
    its tokenizer_config.json (a GGUF's context), else :data:`DEFAULT_MAX_MODEL_LEN`."""
    if (folder / "config.json").is_file():
        return max_position_embeddings(load_model_config(folder))
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return DEFAULT_MAX_MODEL_LEN
    length = config.get("model_max_length") if isinstance(config, dict) else None
    # transformers writes a huge number there for "no limit known"
    return length if type(length) is int and 0 < length <= _LONGEST_CONTEXT else DEFAULT_MAX_MODEL_LEN


def replica_port(port: int, index: int) -> int:
    """Replica ``index``'s HTTP port: ``port + index``, or 0 (a free port each) when ``port`` is 0."""
    if port == 0:
        return 0
    if port + index > 65535:
        raise ConfigError(f"replica {index} would listen on port {port + index}, past 65535: give a lower --port")
    return port + index


def replica_endpoint(endpoint: str, index: int) -> str:
    """Replica ``index``'s KV event endpoint: a TCP endpoint's port plus ``index`` (port 0 stays 0); others
    (ipc, inproc) are refused past the first replica, which they would share."""
    if index == 0:
        return endpoint
    match = _TCP_PORT.match(endpoint)
    if match is None:
        raise ConfigError(
            f"KV event endpoint {endpoint!r} cannot be given to several replicas: name a tcp://HOST:PORT endpoint, "
            "and replica i publishes on PORT + i"
        )
    port = int(match["port"])
    if port == 0:
        return endpoint
    if port + index > 65535:
        raise ConfigError(f"replica {index}'s KV event port would be {port + index}, past 65535 ({endpoint!r})")
    return f"{match['head']}{port + index}"
