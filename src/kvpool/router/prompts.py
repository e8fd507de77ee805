"""A request's prompt as token IDs and block hashes, computed in the router as the replicas compute them.

The router needs a request's block hashes before it picks a replica, so it tokenizes
the prompt itself with the model's own tokenizer, read from the model folder with the
light ``route`` extra only (``tokenizers`` and ``jinja2``; never torch nor transformers):

* the tokenizer is the folder's ``tokenizer.json`` (Hugging Face ``tokenizers``);
* the chat template is ``chat_template.jinja`` or, failing that, the ``chat_template``
  of ``tokenizer_config.json``, rendered as transformers and vLLM render it (a sandboxed
  Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the generation prompt
  added, the special tokens of ``tokenizer_config.json`` as variables);
* a chat's rendered text is encoded without adding special tokens (the template wrote
  them); a text completion is encoded with them, as vLLM and ``kvpool serve`` do.

Asking a replica to tokenize would cost a round trip on every request and load the
replicas the router is trying to spare; the tokenizer loads once, in the background,
and until it has, requests are routed by load alone.

The cache salt comes from :mod:`kvpool.tenancy`, the rule the replicas use, so the
router's hashes for a tenant are the replica's hashes for that tenant.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kvpool.errors import ConfigError
from kvpool.hashing import BlockHash, BlockHasher

__all__ = ["PromptTokenizer", "Tokenizer", "block_hashes", "missing_packages"]

#: What prefix routing imports to tokenize prompts (the ``route`` extra brings both).
PACKAGES = ("tokenizers", "jinja2")


def missing_packages() -> list[str]:
    """The packages of :data:`PACKAGES` this Python lacks (empty: prompts can be tokenized)."""
    import importlib.util

    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


class Tokenizer(Protocol):
    """What the router asks of a tokenizer: prompts as the replicas' engine tokenizes them."""

    @property
    def loaded(self) -> bool: ...

    def load(self) -> None: ...

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def text_tokens(self, prompt: str) -> list[int]: ...


def _special(config: dict[str, Any], name: str) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or a dict with its ``content``."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptTokenizer:
    """The model's tokenizer and chat template, read from a model folder on first use.

    Construction checks only that the folder holds ``tokenizer.json``; :meth:`load`
    reads it and finds the chat template, raising :class:`ConfigError` naming the file
    that is missing or unreadable.
    """

    __slots__ = ("folder", "_tokenizer", "_template", "_specials")

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not (self.folder / "tokenizer.json").is_file():
            raise ConfigError(f"{os.fspath(folder)!r} holds no tokenizer (tokenizer.json is missing)")
        self._tokenizer: Any = None
        self._template: Any = None
        self._specials: dict[str, str] = {}

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self) -> None:
        """Read the tokenizer and the chat template; later calls return at once."""
        if self._tokenizer is not None:
            return
        missing = missing_packages()
        if missing:
            raise ConfigError(f"tokenizing prompts needs {' and '.join(missing)}: pip install 'kvpool[route]'")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as HFTokenizer

        config: dict[str, Any] = {}
        config_path = self.folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read {os.fspath(config_path)!r}: {exc}") from None
            config = loaded if isinstance(loaded, dict) else {}
        source = None
        template_path = self.folder / "chat_template.jinja"
        if template_path.is_file():
            source = template_path.read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        template = None if source is None else env.from_string(source)
        self._specials = {
            name: token
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (token := _special(config, name)) is not None
        }
        try:
            tokenizer = HFTokenizer.from_file(os.fspath(self.folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise ConfigError(f"cannot read {os.fspath(self.folder / 'tokenizer.json')!r}: {exc}") from None
        self._template = template
        self._tokenizer = tokenizer

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's prompt: the chat template with the generation prompt, encoded without special tokens."""
        self.load()
        if self._template is None:
            raise ConfigError(f"the model folder {os.fspath(self.folder)!r} has no chat template")
        text = self._template.render(messages=list(messages), add_generation_prompt=True, **self._specials)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def text_tokens(self, prompt: str) -> list[int]:
        """A text completion's prompt, with the tokenizer's own special tokens as the engine adds them."""
        self.load()
        return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)


def _raise_exception(message: str) -> None:
    raise ConfigError(f"the chat template refused the conversation: {message}")


def block_hashes(hasher: BlockHasher, tokens: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
    """The hashes of the prompt's full blocks, as a replica hashing with ``hasher`` computes them."""
    return hasher.hash_token_ids(tokens, cache_salt=cache_salt)
