"""Tiny random-initialised models saved as model folders, and transformers' own greedy reference.

Two layers, hidden 64, 4 query heads over 2 KV heads, vocabulary 256, a wide
initializer (0.2) so that logits are far from flat, float32, fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
WINDOW = 8

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: A chat template for the word-level tokenizer below.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def build_model(kind: str, **overrides):
    """A deterministic tiny causal LM: llama, qwen2, qwen2-hybrid, mistral or gemma2."""
    import transformers as tf

    fields = {**COMMON, **overrides}
    if kind == "llama":
        config, cls = tf.LlamaConfig(**fields), tf.LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = tf.Qwen2Config(**fields), tf.Qwen2ForCausalLM
    elif kind == "qwen2-hybrid":  # layer 0 full attention, layer 1 sliding window
        config = tf.Qwen2Config(**fields, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    elif kind == "mistral":
        config, cls = tf.MistralConfig(**fields, sliding_window=WINDOW), tf.MistralForCausalLM
    elif kind == "gemma2":
        config = tf.Gemma2Config(**fields, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)
        cls = tf.Gemma2ForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    model = cls(config).eval()
    model.config._attn_implementation = "eager" if kind == "gemma2" else "sdpa"
    return model


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: <unk> <s> </s> user assistant system w0..w249."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system"] + [f"w{i}" for i in range(VOCAB - 6)]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_model(model, folder: Path, *, tokenizer: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer:
        word_tokenizer().save_pretrained(folder)
    return folder


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(6, VOCAB, (length,), generator=gen).tolist()


def reference_tokens(model, prompt: list[int], max_new_tokens: int, *, eos_token_id: int | None = None) -> list[int]:
    """transformers' own greedy ``generate`` for one prompt (no padding); EOS stops it only if given."""
    input_ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    tokens = out[0, len(prompt) :].tolist()
    if eos_token_id is not None and eos_token_id in tokens:  # generate pads after EOS
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens
