"""A small tokenizer folder (trained here: byte-level BPE with chat tokens and a template) and emulated engines."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.cost_model import CostProfile
from kvpool.emulator import EmulatedEngine, EmulatorOptions, ManualClock
from kvpool.tokenizer_files import FolderTokenizer, missing_packages

if missing_packages():  # the route extra's tokenizers and jinja2: every emulated replica reads its tokenizer so
    collect_ignore_glob = ["test_*.py"]

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["alpha", "beta", "gamma", "delta", " ", "\n", "you", "are", "brief", ".", "!", "cache", "block"]

#: A profile with round figures, so a test can say what each step costs.
PROFILE = CostProfile(
    name="test-round-figures",
    source="made up for the tests",
    step_overhead_s=0.01,
    prefill_s_per_token=((1, 0.001),),
    decode_s_per_seq=0.002,
    s_per_context_token=0.0001,
    kv_bytes_per_token=1024,
)


def write_tokenizer_folder(folder: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return folder


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def make_engine(tokenizer_folder: Path) -> Callable[..., EmulatedEngine]:
    """An emulated engine on a manual clock: ``make_engine(num_blocks=..., block_size=..., ...)``."""

    def make(**options: Any) -> EmulatedEngine:
        options.setdefault("profile", PROFILE)
        options.setdefault("num_blocks", 64)
        options.setdefault("block_size", 4)
        options.setdefault("max_model_len", 256)
        return EmulatedEngine(EmulatorOptions(**options), FolderTokenizer(tokenizer_folder), clock=ManualClock())

    return make


def serve_config(**changes: Any) -> Any:
    """A single-tenant server config whose tenants share one cache (no server salt), so hashes are the prompt's."""
    from kvpool.serve import ServeConfig
    from kvpool.tenancy import SaltPolicy

    changes.setdefault("salts", SaltPolicy.shared())
    return ServeConfig(model_name="emulated", api_keys=None, stats_interval=None, **changes)


def vllm_hit(cached_before: list[int], prompt: list[int], block_size: int) -> int:
    """vLLM's prefix hit, worked out by hand: the full blocks ``prompt`` shares with tokens whose KV was computed,
    never the prompt's last token (its logits are needed, so at most ``len(prompt) - 1`` tokens, in full blocks)."""
    common = 0
    for a, b in zip(cached_before, prompt):
        if a != b:
            break
        common += 1
    return min(common // block_size, (len(prompt) - 1) // block_size) * block_size
