"""Grammar-constrained decoding: what xgrammar and llguidance cost on SmolLM2's vocabulary.

For each library that is installed, on SmolLM2's 49,152-token vocabulary:

* ``tokenizer``: building the library's view of the tokenizer (once per server);
* ``compile``: turning a JSON schema (and the free JSON grammar) into a matcher
  ready for its first token (once per request), the first time and again
  (a library may cache);
* ``mask``: one decode step's mask, computed and applied to a ``[49152]``
  float32 logits row, averaged over the tokens of a document the schema
  accepts (the step the sampler pays per constrained row per token);
* ``advance``: accepting one token.

Run: ``python benchmarks/bench_structured.py [--repeat N]`` (needs the
``engine`` extra and the library or libraries to compare).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "12345"},
    "active": True,
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def bench_llguidance(tokenizer: Any, tokens: list[int], vocab: int, repeat: int) -> dict[str, str]:
    import llguidance
    import llguidance.hf

    seconds, ll_tok = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    out = {"tokenizer": _ms(seconds)}
    text = json.dumps(SCHEMA)

    def compile_schema() -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    out["compile (first)"] = _ms(_timed(compile_schema)[0])
    out["compile (again)"] = _ms(statistics.median(_timed(compile_schema)[0] for _ in range(repeat)))
    out["compile json_object"] = _ms(
        _timed(lambda: llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})))[
            0
        ]
    )
    masks, applies, advances = [], [], []
    for _ in range(repeat):
        matcher = compile_schema()
        for token in tokens:
            logits = torch.randn(vocab)
            t0 = time.perf_counter()
            # as kvpool.engine.structured.GrammarMatcher.allowed does: one byte per token
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) != 0
            t1 = time.perf_counter()
            logits.masked_fill_(~allowed, float("-inf"))
            t2 = time.perf_counter()
            assert logits[token] != float("-inf"), token
            ok = matcher.consume_token(token)
            t3 = time.perf_counter()
            assert ok, matcher.get_error()
            masks.append(t1 - t0)
            applies.append(t2 - t1)
            advances.append(t3 - t2)
        assert matcher.is_accepting()
    firsts = masks[:: len(tokens)]
    rest = [m for i, m in enumerate(masks) if i % len(tokens)]
    out["first mask (median)"] = _ms(statistics.median(firsts))
    out["mask (median)"] = _ms(statistics.median(rest))
    out["mask (p99)"] = _ms(sorted(rest)[int(len(rest) * 0.99)])
    out["apply (median)"] = _ms(statistics.median(applies))
    out["advance (median)"] = _ms(statistics.median(advances))
    return out


def bench_xgrammar(tokenizer: Any, tokens: list[int], vocab: int, repeat: int) -> dict[str, str]:
    import xgrammar as xgr

    seconds, info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    out = {"tokenizer": _ms(seconds)}
    text = json.dumps(SCHEMA)

    def compile_schema(cache: bool = True) -> Any:
        compiler = xgr.GrammarCompiler(info, cache_enabled=cache)
        return xgr.GrammarMatcher(compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":")))

    out["compile (first)"] = _ms(_timed(lambda: compile_schema(cache=False))[0])
    out["compile (again)"] = _ms(
        statistics.median(_timed(lambda: compile_schema(cache=False))[0] for _ in range(repeat))
    )
    out["compile json_object"] = _ms(
        _timed(lambda: xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_builtin_json_grammar()))[0]
    )
    masks, applies, advances = [], [], []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(repeat):
        matcher = compile_schema()
        for token in tokens:
            logits = torch.randn(1, vocab)
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            t2 = time.perf_counter()
            assert logits[0, token] != float("-inf"), token
            ok = matcher.accept_token(token)
            t3 = time.perf_counter()
            assert ok
            masks.append(t1 - t0)
            applies.append(t2 - t1)
            advances.append(t3 - t2)
    firsts = masks[:: len(tokens)]
    rest = [m for i, m in enumerate(masks) if i % len(tokens)]
    out["first mask (median)"] = _ms(statistics.median(firsts))
    out["mask (median)"] = _ms(statistics.median(rest))
    out["mask (p99)"] = _ms(sorted(rest)[int(len(rest) * 0.99)])
    out["apply (median)"] = _ms(statistics.median(applies))
    out["advance (median)"] = _ms(statistics.median(advances))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from kvpool.engine.model_store import resolve_model

    folder = resolve_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {vocab} tokens; document {len(tokens)} tokens; torch threads {torch.get_num_threads()}")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        if importlib.util.find_spec(name) is None:
            print(f"{name}: not installed")
            continue
        figures = bench(tokenizer, tokens, vocab, args.repeat)
        print(f"{name}: " + "; ".join(f"{k} {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
