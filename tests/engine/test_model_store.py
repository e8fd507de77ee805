"""The model store: name resolution, offline loading, atomic GGUF conversion.

The slow tests use the real kvpool cache (``$KVPOOL_CACHE_DIR`` or
``~/.cache/kvpool``): the first run converts SmolLM2 (about 20 s), later runs
load the converted folder.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from kvpool import model_names
from kvpool.engine.model_store import (
    CACHE_DIR_ENV,
    DEFAULT_MODEL,
    BundledModel,
    cache_root,
    convert_bundled_model,
    known_models,
    load_model,
    resolve_model,
)
from kvpool.errors import ConfigError

pytestmark = pytest.mark.engine


def test_unknown_name_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="'no-such-model-xyz'"):
        resolve_model("no-such-model-xyz", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was converted or created


def test_folder_without_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    assert cache_root() == Path.home() / ".cache" / "kvpool"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_known_names():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert DEFAULT_MODEL in known_models()


def test_missing_package_is_a_config_error():
    ghost = BundledModel(name="ghost", package="kvpool_no_such_package", gguf_file="x.gguf", folder_name="ghost")
    with pytest.raises(ConfigError, match="kvpool_no_such_package"):
        ghost.gguf_path()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_local_folder_resolves_and_loads_offline(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)

    _forbid_network(monkeypatch)
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path
    model, tokenizer = load_model(tmp_path)
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer("w1 w2")["input_ids"][-2:] == [4, 5]


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    import transformers

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("conversion killed")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", killed)
    destination = tmp_path / "models" / "smollm2-135m-instruct"
    with pytest.raises(KeyboardInterrupt):
        convert_bundled_model(model_names.SMOLLM2, destination)
    assert not destination.exists()
    assert list((tmp_path / "models").iterdir()) == []  # the staging folder is gone too


def _forbid_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model store tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# --- the real default model (slow) -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """(folder, model, tokenizer) of the default model, converted if needed, then loaded without GGUF."""
    with pytest.MonkeyPatch.context() as mp:
        _forbid_network(mp)
        folder = resolve_model(DEFAULT_MODEL)
        # Loading reads the converted folder: the GGUF reader is not even importable meanwhile.
        mp.setitem(sys.modules, "gguf", None)
        model, tokenizer = load_model(folder)
    return folder, model, tokenizer


@pytest.mark.slow
def test_default_model_converts_and_loads(smollm2):
    folder, model, tokenizer = smollm2
    assert folder == cache_root() / "models" / "smollm2-135m-instruct"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert not list(folder.parent.glob(".*partial*"))
    assert list(folder.glob("*.safetensors"))  # what loads without the GGUF reader
    assert model.dtype == torch.float32
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert resolve_model("SmolLM2-135M") == folder  # names are case-insensitive; no reconversion


@pytest.mark.slow
def test_default_model_greedy_matches_generate(smollm2, make_runner, driver_cls, seq_cls, reference):
    _, model, tokenizer = smollm2
    texts = [
        "The paged KV cache stores keys and values in fixed-size blocks so that many requests can share "
        "memory without fragmentation, which",
        "Once upon a time, in a small village at the edge of a great and ancient forest, there lived an old "
        "clockmaker and his curious granddaughter, who",
        "Here is a short list of the reasons why so many people enjoy learning new programming languages in "
        "their spare time: first of all, it",
    ]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    assert all(25 <= len(p) <= 40 for p in prompts), [len(p) for p in prompts]
    runner, allocator = make_runner(model, num_blocks=64, block_size=16)
    seqs = [seq_cls(f"s{i}", list(p), max_new_tokens=8) for i, p in enumerate(prompts)]
    driver_cls(runner, allocator).run(seqs)
    assert runner.num_steps == 8
    for seq, prompt in zip(seqs, prompts):
        assert seq.generated == reference(model, prompt, 8), seq.request_id
