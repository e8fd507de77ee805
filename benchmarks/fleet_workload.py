"""The Mooncake conversation trace as prompt text whose blocks are shared exactly where the trace's are.

The trace (``../shared/traces/conversation_trace.jsonl``) gives each request's arrival time, its
prompt and output lengths and one ``hash_id`` per 512-token block, chained: two requests with the
same id at the same position share their whole prefix up to the end of that block. No text. This
module writes text for it: every trace block becomes 512 words, each a word that the model's
tokenizer encodes as exactly one token (a leading space and letters: the tokenizer's pre-split
keeps a space-led word whole, so a text of such words encodes to one token per word, whatever its
neighbours), drawn from a generator seeded by the block's id. A request's prompt is its blocks'
words, the last block cut to the request's length. Two prompts then share exactly the tokens the
trace says they share, on any block size that divides 512, in kvpool, in vLLM and in any router
that tokenizes the text.

Used by ``bench_fleet.py``; also a command, to look at a slice::

    python benchmarks/fleet_workload.py --first 0 --count 5
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Tokens per trace block (the trace's own unit).
TRACE_BLOCK_TOKENS = 512
#: Where the trace lives, from the project's root.
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line: arrival (seconds since the trace's first request), lengths, and its block ids."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FleetRequest:
    """A trace request made sendable: its prompt text and how many tokens that text encodes to."""

    trace: TraceRequest
    prompt: str
    prompt_tokens: int


def read_trace(
    path: Path = DEFAULT_TRACE, *, first: int = 0, count: int | None = None, conversations: int = 1
) -> list[TraceRequest]:
    """``count`` requests from line ``first`` on, arrival times made relative to the first one taken.

    ``conversations=K`` keeps one conversation in K: the requests whose second block id is a multiple
    of K (every request starts with block 0, the trace's common first block; the second block names
    the conversation, so its follow-ups are all kept or all dropped). Requests of one block are then
    dropped. A slice of whole conversations keeps the trace's reuse, which a run of consecutive lines
    cuts short (200 lines span 72 s of the hour and 6% of their tokens are reusable; one conversation
    in 40, 342 requests over the whole hour, 51%).
    """
    if conversations < 1:
        raise ValueError(f"conversations must be at least 1, got {conversations}")
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < first:
                continue
            if count is not None and len(out) >= count:
                break
            row = json.loads(line)
            if conversations > 1 and (len(row["hash_ids"]) < 2 or row["hash_ids"][1] % conversations):
                continue
            out.append(
                TraceRequest(
                    i, row["timestamp"] / 1000.0, row["input_length"], row["output_length"], tuple(row["hash_ids"])
                )
            )
    if out:
        t0 = out[0].arrival_s
        out = [TraceRequest(r.index, r.arrival_s - t0, r.input_length, r.output_length, r.hash_ids) for r in out]
    return out


def one_token_words(tokenizer: object, *, limit: int = 4096) -> list[str]:
    """Words (with their leading space) the tokenizer encodes as one token each, sorted, at most ``limit``."""
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    words = []
    for piece in sorted(vocab):
        if not piece.startswith("\u0120"):  # byte-level BPE spells a leading space as 'Ġ'
            continue
        word = piece[1:]
        if 3 <= len(word) <= 10 and word.isascii() and word.isalpha() and word.islower():
            text = " " + word
            if tokenizer.encode(text, add_special_tokens=False).ids == [vocab[piece]]:  # type: ignore[attr-defined]
                words.append(text)
        if len(words) >= limit:
            break
    if len(words) < 256:
        raise ValueError(f"the tokenizer has only {len(words)} one-token words; this workload needs a byte-level BPE")
    return words


def block_words(words: Sequence[str], hash_id: int, position: int, n: int) -> list[str]:
    """The first ``n`` words of trace block ``hash_id`` at ``position`` (the same block: the same words)."""
    rng = random.Random(hash_id * 1_000_003 + position)
    return [words[rng.randrange(len(words))] for _ in range(n)]


def prompt_text(words: Sequence[str], request: TraceRequest, *, max_tokens: int | None = None) -> tuple[str, int]:
    """The request's prompt and its token count (cut to ``max_tokens`` when given)."""
    length = request.input_length if max_tokens is None else min(request.input_length, max_tokens)
    parts: list[str] = []
    for position, hash_id in enumerate(request.hash_ids):
        take = min(TRACE_BLOCK_TOKENS, length - position * TRACE_BLOCK_TOKENS)
        if take <= 0:
            break
        parts.extend(block_words(words, hash_id, position, take))
    return "".join(parts), len(parts)


def fleet_requests(
    tokenizer: object, trace: Sequence[TraceRequest], *, max_prompt_tokens: int | None = None
) -> Iterator[FleetRequest]:
    """Each trace request with its prompt text."""
    words = one_token_words(tokenizer)
    for request in trace:
        text, n = prompt_text(words, request, max_tokens=max_prompt_tokens)
        yield FleetRequest(request, text, n)


def load_tokenizer(folder: Path) -> object:
    """The ``tokenizers`` tokenizer of a model folder (its ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def default_model_folder() -> Path:
    """kvpool's default model's folder (SmolLM2-135M-Instruct), as ``kvpool serve`` converts it."""
    from kvpool.model_names import bundled_model, converted_folder

    model = bundled_model("smollm2-135m-instruct")
    assert model is not None
    return converted_folder(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=1, help="keep one conversation in this many")
    parser.add_argument("--model-folder", type=Path, default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model_folder or default_model_folder())
    for fr in fleet_requests(
        tokenizer, read_trace(args.trace, first=args.first, count=args.count, conversations=args.conversations)
    ):
        encoded = len(tokenizer.encode(fr.prompt, add_special_tokens=False).ids)  # type: ignore[attr-defined]
        print(
            f"line {fr.trace.index}: at {fr.trace.arrival_s:.3f} s, {fr.prompt_tokens} prompt tokens "
            f"(encodes to {encoded}), {fr.trace.output_length} output, blocks {list(fr.trace.hash_ids[:4])}..."
        )


if __name__ == "__main__":
    main()
