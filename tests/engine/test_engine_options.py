"""vLLM's request options end to end on a tiny model: each changes the output as its formula says.

References are computed here from transformers' own forward passes and
``generate`` (its repetition penalty is the same rule), independently of the
engine's sampler.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpool.engine.llm import LLM
from kvpool.engine.sampling import SamplingParams
from kvpool.errors import ConfigError
from kvpool.scheduler import FinishReason
from tests.engine.tiny_models import build_model, random_prompt, reference_tokens, save_model

pytestmark = pytest.mark.engine

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model = build_model("llama")
    return save_model(model, tmp_path_factory.mktemp("llama"), tokenizer=True), model


def make_llm(folder: Any, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        block_size=BLOCK, kv_cache_memory=256 * BLOCK_BYTES, threads=1, log=lambda line: None
    )
    options.update(kwargs)
    return LLM(folder, **options)


@pytest.fixture(scope="module")
def llm(tiny: tuple[Any, Any]) -> LLM:
    return make_llm(tiny[0])


def next_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
    return logits.clone()  # a normal tensor, which the callers may change in place


def penalised_greedy(model: Any, prompt: list[int], steps: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's presence and frequency penalties, written out token by token."""
    out: list[int] = []
    for _ in range(steps):
        logits = next_logits(model, prompt + out)
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


def test_max_tokens_none_generates_to_the_end_of_the_context(tiny: tuple[Any, Any]) -> None:
    engine_llm = make_llm(tiny[0], max_model_len=24)
    prompt = random_prompt(10, seed=3)
    [out] = engine_llm.generate(prompt, SamplingParams(max_tokens=None, ignore_eos=True))
    assert out.num_output_tokens == 24 - 10 and out.finish_reason is FinishReason.LENGTH
    assert list(out.output_token_ids) == reference_tokens(tiny[1], prompt, 14)


def test_repetition_penalty_matches_transformers_generate(llm: LLM, tiny: tuple[Any, Any]) -> None:
    _, model = tiny
    prompt = random_prompt(9, seed=5)
    plain = reference_tokens(model, prompt, 12)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
            repetition_penalty=1.8, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
    assert ref != plain  # the penalty changes this output, so the comparison can fail
    [out] = llm.generate(prompt, SamplingParams(max_tokens=12, repetition_penalty=1.8, ignore_eos=True))
    assert list(out.output_token_ids) == ref


def test_presence_and_frequency_penalties_follow_openais_formula(llm: LLM, tiny: tuple[Any, Any]) -> None:
    _, model = tiny
    prompt = random_prompt(6, seed=8)
    plain = reference_tokens(model, prompt, 10)
    changed = 0
    for presence, frequency in [(2.0, 0.0), (0.0, 2.0), (-2.0, 0.5), (2.0, 2.0)]:
        ref = penalised_greedy(model, prompt, 10, presence, frequency)
        params = SamplingParams(max_tokens=10, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
        [out] = llm.generate(prompt, params)
        assert list(out.output_token_ids) == ref, (presence, frequency)
        changed += ref != plain
    assert changed  # the penalties change these outputs, so the comparison can fail


def test_min_tokens_masks_eos_until_reached(tiny: tuple[Any, Any], tmp_path: Any) -> None:
    _, model = tiny
    prompt = random_prompt(7, seed=50)
    reference = reference_tokens(model, prompt, 12)
    k = next(i for i in range(2, 10) if reference[i] not in reference[:i])
    eos = reference[k]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    folder = save_model(model, tmp_path / "eos")
    model.config.eos_token_id = model.generation_config.eos_token_id = 2
    engine_llm = make_llm(folder)
    [plain] = engine_llm.generate(prompt, SamplingParams(max_tokens=12))
    assert plain.finish_reason is FinishReason.EOS and plain.num_output_tokens == k + 1
    [held] = engine_llm.generate(prompt, SamplingParams(max_tokens=12, min_tokens=k + 3))
    outs = list(held.output_token_ids)
    assert outs[:k] == reference[:k]
    assert eos not in outs[: k + 3]  # masked, not merely ignored
    # At step k the EOS logit is -inf: the next best token of the model's own logits.
    masked = next_logits(model, prompt + reference[:k])
    masked[eos] = float("-inf")
    assert outs[k] == int(masked.argmax())
    assert held.num_output_tokens >= k + 3


def test_stop_token_ids_report_the_token_as_stop_reason(llm: LLM, tiny: tuple[Any, Any]) -> None:
    prompt = random_prompt(7, seed=50)
    reference = reference_tokens(tiny[1], prompt, 12)
    k = next(i for i in range(2, 12) if reference[i] not in reference[:i])
    [out] = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=(reference[k],), ignore_eos=True))
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == reference[k]
    assert out.text == llm.engine.decode(reference[:k])  # the stop token's text is left out
    [kept] = llm.generate(
        prompt, SamplingParams(max_tokens=12, stop_token_ids=(reference[k],), include_stop_str_in_output=True)
    )
    assert kept.text == llm.engine.decode(reference[: k + 1])
    [length] = llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert length.stop_reason is None


def test_a_stop_string_across_tokens_ends_the_request_and_its_stream(llm: LLM, tiny: tuple[Any, Any]) -> None:
    engine = llm.engine
    prompt = random_prompt(7, seed=21)
    reference = reference_tokens(tiny[1], prompt, 12)
    full = engine.decode(reference)
    words = full.split(" ")
    # The end of word 3 and the start of word 4: a stop string that no single token holds.
    stop = words[3][-1] + " " + words[4][:2]
    cut = full.index(stop)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, stop=("zzz", stop), ignore_eos=True))
    shown, output = [], None
    while output is None:
        for delta in engine.step():
            if delta.request_id == rid:
                shown.append(delta.text)
                output = delta.output
    assert output.finish_reason is FinishReason.STOP and output.stop_reason == stop
    assert output.text == full[:cut] == "".join(shown)
    completing = next(m for m in range(1, 13) if stop in engine.decode(reference[:m]))
    assert list(output.output_token_ids) == reference[:completing]  # ended on the token that completed it
    [kept] = llm.generate(
        prompt, SamplingParams(max_tokens=12, stop=(stop,), include_stop_str_in_output=True, ignore_eos=True)
    )
    assert kept.text == full[: cut + len(stop)]


def test_logprobs_are_the_models_log_softmax(llm: LLM, tiny: tuple[Any, Any]) -> None:
    _, model = tiny
    prompt = random_prompt(8, seed=9)
    [out] = llm.generate(prompt, SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True, temperature=0.7, seed=4))
    assert out.logprobs is not None and len(out.logprobs) == 5
    for i, entry in enumerate(out.logprobs):
        ref = torch.log_softmax(next_logits(model, prompt + list(out.output_token_ids[:i])), dim=-1)
        assert entry.token_id == out.output_token_ids[i]
        assert entry.logprob == pytest.approx(float(ref[entry.token_id]), abs=1e-4)
        best = torch.topk(ref, 3)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
    [none] = llm.generate(prompt, SamplingParams(max_tokens=2))
    assert none.logprobs is None


def test_n_sequences_of_one_prompt_compute_it_once(llm: LLM) -> None:
    prompt = random_prompt(18, seed=77)
    n = 4
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([prompt] * n, params)
    cacheable = (len(prompt) - 1) // BLOCK * BLOCK  # full blocks short of the last prompt token
    assert sum(o.num_cached_tokens for o in outs) == (n - 1) * cacheable
    assert sum(o.num_computed_tokens for o in outs) == len(prompt) + (n - 1) * (len(prompt) - cacheable) + n * 2
    again = llm.generate([prompt] * n, params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]  # seed + i: reproducible


def test_a_seeded_request_draws_the_same_alone_and_in_a_batch(llm: LLM) -> None:
    prompt = random_prompt(9, seed=31)
    seeded = SamplingParams(max_tokens=8, temperature=1.2, top_p=0.9, min_p=0.05, presence_penalty=0.5, seed=1234)
    [alone] = llm.generate(prompt, seeded)
    others = [random_prompt(5 + i, seed=40 + i) for i in range(3)]
    crowd = llm.generate(
        [others[0], prompt, others[1], others[2]],
        [SamplingParams(max_tokens=6, temperature=1.0), seeded, SamplingParams(max_tokens=3), SamplingParams(max_tokens=9, temperature=0.5, seed=1)],
    )  # fmt: skip
    assert crowd[1].output_token_ids == alone.output_token_ids


def test_a_penalty_that_would_overflow_the_row_is_refused_before_it_runs(llm: LLM, tiny: tuple[Any, Any]) -> None:
    """repetition_penalty 1e-300 once made its row's logits infinite (the request failed in the step); it is
    now refused when the parameters are built, and the engine serves the others as before."""
    _, model = tiny
    honest = random_prompt(6, seed=2)
    with pytest.raises(ConfigError, match="repetition_penalty"):
        SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=1e-300, ignore_eos=True)
    [out] = llm.generate([honest], [SamplingParams(max_tokens=4, ignore_eos=True)])
    assert out.error is None and list(out.output_token_ids) == reference_tokens(model, honest, 4)


def test_stop_strings_need_a_tokenizer(tmp_path: Any) -> None:
    folder = save_model(build_model("llama"), tmp_path / "bare")
    engine_llm = make_llm(folder)
    with pytest.raises(ConfigError, match="'ab'"):
        engine_llm.engine.add_request([5, 6], SamplingParams(stop=("ab",)))
    assert not engine_llm.engine.has_unfinished_requests()


def test_the_scheduler_lets_no_end_token_stop_a_request_before_min_tokens() -> None:
    """Even a model that samples EOS or a stop token anyway (the mask aside) is not stopped early."""
    from kvpool.manager import KVCacheManager
    from kvpool.request import Request
    from kvpool.scheduler import Scheduler, SchedulerConfig, StopConditions, run_to_completion, sample_from

    scheduler = Scheduler(KVCacheManager(64, 4), SchedulerConfig())
    stop = StopConditions(max_tokens=10, stop_token_ids=frozenset({7}), eos_token_id=2, min_tokens=3)
    scheduler.add_request(Request("a", [5, 6, 8]), stop)
    scheduler.add_request(Request("b", [5, 6, 9]), stop)
    done = {m.request_id: m for m in run_to_completion(scheduler, sample_from({"a": [2, 7, 2, 9], "b": [7, 7, 7, 7]}))}
    assert list(scheduler.request("a").output_token_ids) == [2, 7, 2, 9, 2]  # the 4th token may end it
    assert done["a"].finish_reason is FinishReason.EOS
    assert list(scheduler.request("b").output_token_ids) == [7, 7, 7, 7]
    assert done["b"].finish_reason is FinishReason.STOP


def test_streamed_deltas_carry_each_tokens_logprobs(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request(random_prompt(6, seed=4), SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True))
    streamed, output = [], None
    while output is None:
        for delta in engine.step():
            if delta.request_id == rid:
                assert delta.logprobs is not None and [e.token_id for e in delta.logprobs] == list(delta.token_ids)
                streamed.extend(delta.logprobs)
                output = delta.output
    assert output.logprobs == tuple(streamed)
