"""The real default model through the whole engine (slow: loads SmolLM2-135M, converts it on first use)."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from kvpool.scheduler import FinishReason
from tests.engine.tiny_models import reference_tokens

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TEXTS = [
    "The paged KV cache stores keys and values in fixed-size blocks so that many requests can share "
    "memory without fragmentation, which",
    "Once upon a time, in a small village at the edge of a great and ancient forest, there lived an old "
    "clockmaker and his curious granddaughter, who",
    "Here is a short list of the reasons why so many people enjoy learning new programming languages in "
    "their spare time: first of all, it",
]


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine's cores are shared; one thread is the steadiest
    try:
        yield LLM(
            kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=256, threads=1, log=lambda line: None
        )
    finally:
        torch.set_num_threads(threads)


def test_greedy_tokens_equal_transformers_generate(llm):
    tokenizer = llm.tokenizer
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert all(25 <= len(p) <= 40 for p in prompts), [len(p) for p in prompts]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    model = llm.engine.setup.model  # the same weights the runner computes with
    for prompt, out in zip(prompts, outputs):
        assert list(out.output_token_ids) == reference_tokens(model, prompt, 12)
        assert out.text == tokenizer.decode(list(out.output_token_ids), skip_special_tokens=True)


def test_chat_answers_and_a_repeat_hits_the_prefix_cache(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    [first] = llm.chat(question, SamplingParams(max_tokens=16))
    assert "Paris" in first.text
    assert first.finish_reason is FinishReason.EOS
    [again] = llm.chat(question, SamplingParams(max_tokens=16))
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16 > 0
    assert again.num_computed_tokens == first.num_computed_tokens - again.num_cached_tokens
