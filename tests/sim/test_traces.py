"""Trace formats: Mooncake expansion, the token-level format, the writer, bad input."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

import pytest

from kvpool.errors import ExternalDataError, KVPoolError
from kvpool.sim.traces import (
    MAX_HASH_ID,
    HashBlockSegment,
    OutputSegment,
    SharedSegment,
    TokenSegment,
    TraceError,
    TraceFormat,
    TraceRequest,
    UniqueSegment,
    detect_format,
    iter_trace,
    load_trace,
    write_trace,
)
from kvpool.sim.workloads import WorkloadKind, generate_workload


def _write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _mooncake(ts: float, length: int, ids: list[int], out: int = 10) -> dict:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}


def _chain_keys(tokens: array, block_size: int) -> list[object]:
    """Chained block keys of full blocks, as a paged manager computes them (exact tuples)."""
    keys: list[object] = []
    parent: object = None
    for b in range(len(tokens) // block_size):
        parent = (parent, tuple(tokens[b * block_size : (b + 1) * block_size]))
        keys.append(parent)
    return keys


# ----------------------------------------------------------------------------- Mooncake


def test_mooncake_expansion_tokens_ids_and_lengths(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "conv.jsonl", [_mooncake(0, 1000, [0, 1], 7), _mooncake(12, 512, [0])])
    reqs = load_trace(path)
    assert [r.request_id for r in reqs] == ["conv:1", "conv:2"]
    first = reqs[0]
    assert first.arrival_ms == 0.0 and isinstance(first.arrival_ms, float)
    assert (first.prompt_length, first.output_length, first.hash_ids) == (1000, 7, (0, 1))
    tokens = first.prompt_token_ids()
    assert isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4
    assert list(tokens) == list(range(0, 512)) + list(range(512, 512 + 488))
    assert list(reqs[1].prompt_token_ids()) == list(range(512))
    assert reqs[1].arrival_ms == 12.0


def _random_chained_trace(rng: random.Random, n_requests: int) -> list[dict]:
    """Mooncake lines over a random tree of hash ids (each id: one position, one parent)."""
    parent: list[int] = []
    lines = []
    for _ in range(n_requests):
        if parent and rng.random() < 0.7:
            node = rng.randrange(len(parent))
            path = [node]
            while parent[path[-1]] >= 0:
                path.append(parent[path[-1]])
            path.reverse()
        else:
            path = []
        for _ in range(rng.randint(0 if path else 1, 3)):
            parent.append(path[-1] if path else -1)
            path.append(len(parent) - 1)
        length = 512 * (len(path) - 1) + rng.randint(1, 512)
        lines.append(_mooncake(0, length, path))
    return lines


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256, 512])
def test_mooncake_expansion_reproduces_id_sharing_at_any_block_size(tmp_path: Path, block_size: int) -> None:
    rng = random.Random(block_size)
    lines = _random_chained_trace(rng, 40)
    reqs = load_trace(_write_lines(tmp_path / "tree.jsonl", lines))
    keys = [_chain_keys(r.prompt_token_ids(), block_size) for r in reqs]
    for i in range(len(reqs)):
        for j in range(i + 1, len(reqs)):
            a, b = reqs[i], reqs[j]
            # Tokens the ids say are common: equal ids share content (the shorter copy of a
            # partial last block), and the first differing id differs from its first token.
            common = 0
            for pos, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)):
                if x != y:
                    break
                common += min(512, a.prompt_length - 512 * pos, b.prompt_length - 512 * pos)
            expected = min(common, a.prompt_length, b.prompt_length) // block_size
            shared = 0
            for ka, kb in zip(keys[i], keys[j]):
                if ka != kb:
                    break
                shared += 1
            assert shared == expected, (i, j, a.hash_ids, b.hash_ids)


def test_mooncake_hash_id_bound(tmp_path: Path) -> None:
    ok = load_trace(_write_lines(tmp_path / "ok.jsonl", [_mooncake(0, 512, [MAX_HASH_ID])]))
    assert ok[0].prompt_token_ids()[-1] == 2**32 - 1
    with pytest.raises(TraceError, match=r"big\.jsonl line 1: field 'hash_ids' .*8388608"):
        load_trace(_write_lines(tmp_path / "big.jsonl", [_mooncake(0, 512, [MAX_HASH_ID + 1])]))


def test_mooncake_inconsistent_chain_is_rejected(tmp_path: Path) -> None:
    lines = [_mooncake(0, 1024, [0, 1]), _mooncake(0, 1024, [2, 1])]
    with pytest.raises(TraceError, match=r"x\.jsonl line 2: field 'hash_ids' id 1 .*on line 1"):
        load_trace(_write_lines(tmp_path / "x.jsonl", lines))


def test_mooncake_zero_length_prompt_has_no_ids(tmp_path: Path) -> None:
    reqs = load_trace(_write_lines(tmp_path / "z.jsonl", [_mooncake(0, 0, [], 3)]))
    assert reqs[0].prompt_length == 0 and len(reqs[0].prompt_token_ids()) == 0
    assert len(reqs[0].output_token_ids()) == 3


# ------------------------------------------------------------------------- bad input


BAD_MOONCAKE = [
    ('{"timestamp": 0, "input_length": 5,', 1, None, "malformed JSON"),
    ({"timestamp": 0, "output_length": 1, "hash_ids": [0]}, 1, "input_length", "is missing"),
    (_mooncake(0, -3, []), 1, "input_length", "must be a non-negative integer, got -3"),
    (_mooncake(0, "12", [0]), 1, "input_length", "got '12'"),
    (_mooncake(0, 12.0, [0]), 1, "input_length", "got 12.0"),
    (_mooncake(0, True, [0]), 1, "input_length", "got True"),
    (_mooncake(-1, 12, [0]), 1, "timestamp", "finite number >= 0"),
    (_mooncake("0", 12, [0]), 1, "timestamp", "finite number >= 0"),
    ({"timestamp": 0, "input_length": 12, "output_length": -1, "hash_ids": [0]}, 1, "output_length", "got -1"),
    (_mooncake(0, 1025, [0, 1]), 1, "hash_ids", "has 2 ids but a length of 1025 tokens needs ceil(1025/512) = 3"),
    (_mooncake(0, 12, "0"), 1, "hash_ids", "must be a list"),
    (_mooncake(0, 12, [-1]), 1, "hash_ids", "got -1 at index 0"),
    ("[1, 2]", 1, None, "must be a JSON object, got list"),
]


@pytest.mark.parametrize(("line", "lineno", "field", "text"), BAD_MOONCAKE)
def test_bad_mooncake_lines_name_file_line_and_field(
    tmp_path: Path, line: object, lineno: int, field: str | None, text: str
) -> None:
    path = _write_lines(tmp_path / "conversation.jsonl", [line])
    with pytest.raises(TraceError) as info:
        load_trace(path, "mooncake")
    err = info.value
    assert isinstance(err, ExternalDataError) and isinstance(err, ValueError) and not isinstance(err, KVPoolError)
    assert (err.file, err.line, err.field) == ("conversation.jsonl", lineno, field)
    assert str(err).startswith(f"conversation.jsonl line {lineno}: ")
    if field is not None:
        assert f"field '{field}' " in str(err)
    assert text in str(err)


def test_error_on_a_later_line_reports_that_line(tmp_path: Path) -> None:
    lines = [_mooncake(0, 512, [0])] * 16 + [_mooncake(5, -3, [])]
    path = _write_lines(tmp_path / "conversation.jsonl", lines)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == (
        "conversation.jsonl line 17: field 'input_length' must be a non-negative integer, got -3"
    )


def test_blank_lines_are_skipped_but_counted(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "b.jsonl", [_mooncake(0, 512, [0]), "", "   ", '{"oops"'])
    with pytest.raises(TraceError, match=r"b\.jsonl line 4: malformed JSON"):
        load_trace(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=r"^empty\.jsonl: file is empty"):
        load_trace(path)
    with pytest.raises(TraceError, match="file is empty"):
        detect_format(path)


def test_format_detection_and_override(tmp_path: Path) -> None:
    moon = _write_lines(tmp_path / "m.jsonl", [_mooncake(0, 512, [0])])
    tok = _write_lines(tmp_path / "t.jsonl", [{"id": "a", "arrival_ms": 0, "output_length": 1, "token_ids": [1]}])
    assert detect_format(moon) is TraceFormat.MOONCAKE
    assert detect_format(tok) is TraceFormat.TOKENS
    with pytest.raises(TraceError, match=r"m\.jsonl line 1: field 'timestamp' is not a field"):
        load_trace(moon, TraceFormat.TOKENS)
    with pytest.raises(TraceError, match=r"t\.jsonl line 1: field 'timestamp' is missing"):
        load_trace(tok, "mooncake")
    with pytest.raises(TraceError, match="unknown trace format 'csv'"):
        load_trace(tok, "csv")
    unknown = _write_lines(tmp_path / "u.jsonl", [{"prompt": "hi"}])
    with pytest.raises(TraceError, match=r"u\.jsonl line 1: cannot tell the format"):
        load_trace(unknown)


# ----------------------------------------------------------------------- token level


def _tok(rid: str, **fields: object) -> dict:
    arrival, output = fields.pop("arrival_ms", 0), fields.pop("output_length", 4)
    return {"id": rid, "arrival_ms": arrival, "output_length": output, **fields}


def test_token_format_segments_follows_salt_and_lora(tmp_path: Path) -> None:
    lines = [
        _tok("a", segments=[{"shared": "sys", "length": 40}, {"unique": 7}], cache_salt="t1", lora_name="ad"),
        _tok("b", arrival_ms=2.5, segments=[{"shared": "sys", "length": 24}, {"tokens": [5, 6]}]),
        _tok("c", arrival_ms=3, follows="a", segments=[{"unique": 3}], prompt_length=54),
        _tok("d", arrival_ms=4, follows="c"),
        _tok("e", arrival_ms=5, token_ids=[1, 2, 3], output_length=0),
        _tok("f", segments=[{"hash_blocks": [7, 8], "length": 600}]),
    ]
    a, b, c, d, e, f = load_trace(_write_lines(tmp_path / "t.jsonl", lines))
    assert (a.cache_salt, a.lora_name, b.cache_salt, b.lora_name) == ("t1", "ad", None, None)
    assert (a.prompt_length, b.prompt_length, c.prompt_length) == (47, 26, 47 + 4 + 3)
    pa, pb = a.prompt_token_ids(), b.prompt_token_ids()
    assert pa[:40] == SharedSegment("sys", 40).token_ids() and pa[:24] == pb[:24] and list(pb[24:]) == [5, 6]
    assert a.prompt_token_ids() == pa  # deterministic
    assert c.follows == "a" and c.prompt_token_ids()[:51] == pa + a.output_token_ids()
    assert c.prompt_token_ids()[51:] != UniqueSegment(3, "a", 1).token_ids()
    assert d.follows == "c" and d.prompt_token_ids() == c.prompt_token_ids() + c.output_token_ids()
    assert list(e.prompt_token_ids()) == [1, 2, 3] and len(e.output_token_ids()) == 0
    assert f.hash_ids == (7, 8) and f.prompt_token_ids()[512] == 8 * 512
    outputs = [r.output_token_ids() for r in (a, b, c, d)]
    assert len({o.tobytes() for o in outputs}) == 4  # outputs never coincide


BAD_TOKEN_LINES = [
    (_tok("x", segments=[{"unique": -3}]), "segments[0].unique", "got -3"),
    (_tok("x", segments=[{"shared": "s"}]), "segments[0].length", "is missing"),
    (_tok("x", segments=[{"shared": "", "length": 2}]), "segments[0].shared", "non-empty string"),
    (_tok("x", segments=[{"shared": "s", "unique": 2, "length": 2}]), "segments[0]", "exactly one of"),
    (_tok("x", segments=[{"unique": 2, "length": 2}]), "segments[0].length", "not allowed"),
    (_tok("x", segments=[3]), "segments[0]", "must be an object"),
    (_tok("x", segments={"unique": 3}), "segments", "must be a list"),
    (_tok("x", token_ids=[1, -2]), "token_ids", "got -2 at index 1"),
    (_tok("x", token_ids=[1, 2**32]), "token_ids", "[0, 2**32)"),
    (_tok("x", token_ids=[1, True]), "token_ids", "got True at index 1"),
    (_tok("x", token_ids=[1], segments=[]), "token_ids", "exclusive"),
    (_tok("x"), "segments", "is missing"),
    (_tok("x", follows="nobody"), "follows", "names 'nobody', which no earlier line defines"),
    (_tok("x", token_ids=[1], prompt_length=2), "prompt_length", "is 2 but the segments hold 1 tokens"),
    (_tok("x", token_ids=[1], cache_salt=5), "cache_salt", "must be a string"),
    (_tok("x", token_ids=[1], colour="red"), "colour", "is not a field"),
    (_tok("", token_ids=[1]), "id", "non-empty string"),
    (_tok("x", token_ids=[1], output_length=-1), "output_length", "got -1"),
    (_tok("x", token_ids=[1], arrival_ms=float("nan")), "arrival_ms", "finite"),
    (_tok("x", segments=[{"hash_blocks": [1], "length": 513}]), "segments[0].hash_blocks", "needs ceil"),
]


@pytest.mark.parametrize(("line", "field", "text"), BAD_TOKEN_LINES)
def test_bad_token_lines_name_file_line_and_field(tmp_path: Path, line: dict, field: str, text: str) -> None:
    path = _write_lines(tmp_path / "tok.jsonl", [_tok("ok", token_ids=[1]), line])
    with pytest.raises(TraceError) as info:
        load_trace(path, TraceFormat.TOKENS)
    assert (info.value.file, info.value.line, info.value.field) == ("tok.jsonl", 2, field)
    assert str(info.value).startswith(f"tok.jsonl line 2: field '{field}' ")
    assert text in str(info.value)


def test_duplicate_id_is_rejected(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "d.jsonl", [_tok("a", token_ids=[1]), _tok("a", token_ids=[2])])
    with pytest.raises(TraceError, match=r"d\.jsonl line 2: field 'id' repeats request id 'a'"):
        load_trace(path)


def test_iter_trace_is_lazy(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "lazy.jsonl", [_tok("a", token_ids=[1]), "not json"])
    it = iter_trace(path)
    assert next(it).request_id == "a"
    with pytest.raises(TraceError, match="line 2"):
        next(it)


# ------------------------------------------------------------------------ the type


def test_trace_request_validation_and_create() -> None:
    seg = SharedSegment("sys", 10)
    req = TraceRequest.create("r1", 3, [seg, UniqueSegment(5), UniqueSegment(5)], 2, cache_salt="s")
    assert req.prompt_length == 20 and req.arrival_ms == 3.0 and req.hash_ids is None
    u1, u2 = req.segments[1], req.segments[2]
    assert (u1.owner, u1.index, u2.index) == ("r1", 1, 2) and u1.token_ids() != u2.token_ids()
    nxt = TraceRequest.create("r2", 4, [UniqueSegment(1)], 1, follows=req)
    assert nxt.segments[:4] == (*req.segments, OutputSegment("r1", 2)) and nxt.follows == "r1"
    with pytest.raises(TraceError, match="field 'segments\\[0\\]' is an unowned"):
        TraceRequest("r", 0, (UniqueSegment(3),), 1)
    with pytest.raises(TraceError, match="field 'output_length'"):
        TraceRequest("r", 0, (), -1)
    with pytest.raises(TraceError, match="field 'arrival_ms'"):
        TraceRequest("r", float("inf"), (), 1)
    with pytest.raises(TraceError, match="field 'tokens'"):
        TokenSegment.of([1, -1])
    with pytest.raises(TraceError, match="field 'hash_ids'"):
        HashBlockSegment((1, 2), 100)
    with pytest.raises(AttributeError):
        req.output_length = 5  # type: ignore[misc]


# --------------------------------------------------------------------------- writer


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_write_then_load_round_trips_generated_workloads(tmp_path: Path, kind: WorkloadKind) -> None:
    reqs = generate_workload(kind, num_requests=60, seed=3)
    path = tmp_path / "w.jsonl"
    assert write_trace(reqs, path) == 60
    again = load_trace(path)
    assert again == reqs
    for r in reqs[::7]:
        twin = again[reqs.index(r)]
        assert twin.prompt_token_ids() == r.prompt_token_ids()
        assert twin.output_token_ids() == r.output_token_ids()
    if any(r.follows for r in reqs):
        assert any('"follows"' in line for line in path.read_text().splitlines())


def test_writer_without_the_previous_turn_writes_the_whole_prompt(tmp_path: Path) -> None:
    first = TraceRequest.create("a", 0, [SharedSegment("s", 20), UniqueSegment(4)], 6)
    second = TraceRequest.create("b", 1, [UniqueSegment(3), TokenSegment.of([9, 9])], 2, follows=first, lora_name="l")
    path = tmp_path / "only_b.jsonl"
    write_trace([second], path)
    (record,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert "follows" not in record and record["lora_name"] == "l" and record["prompt_length"] == 35
    (loaded,) = load_trace(path)
    assert loaded.follows is None and loaded.prompt_token_ids() == second.prompt_token_ids()
    with pytest.raises(TraceError, match="repeats request id 'b'"):
        write_trace([second, second], tmp_path / "dup.jsonl")


def test_writer_keeps_mooncake_requests_compact(tmp_path: Path) -> None:
    moon = load_trace(_write_lines(tmp_path / "m.jsonl", [_mooncake(1.5, 1000, [0, 1], 3)]))
    out = tmp_path / "m_tokens.jsonl"
    write_trace(moon, out)
    assert json.loads(out.read_text())["segments"] == [{"hash_blocks": [0, 1], "length": 1000}]
    (again,) = load_trace(out)
    assert again.hash_ids == (0, 1) and again.prompt_token_ids() == moon[0].prompt_token_ids()


# ------------------------------------------------------------------- the real trace


def test_conversation_trace_matches_its_readme(conversation_requests: list[TraceRequest]) -> None:
    reqs = conversation_requests
    assert len(reqs) == 12_031
    assert sum(r.prompt_length for r in reqs) == 144_793_823
    assert sum(r.output_length for r in reqs) == 4_122_048
    assert sum(len(r.hash_ids) for r in reqs) == 288_500
    assert len({h for r in reqs for h in r.hash_ids}) == 182_790
    assert all(r.hash_ids[0] == 0 for r in reqs)
    assert (reqs[0].arrival_ms, max(r.arrival_ms for r in reqs)) == (0.0, 3_536_999.0)
    longest = max(reqs, key=lambda r: r.prompt_length)
    assert longest.prompt_length == 126_195 and len(longest.prompt_token_ids()) == 126_195
