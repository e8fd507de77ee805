"""Every shell and Python block in README.md and docs/*.md runs as pasted, or says why not.

Each ```bash, ```sh and ```python block is run, unless an HTML comment on the line right
before its opening fence says otherwise. The comment holds ``;``-separated marks:

* ``<!-- excerpt: WHY -->``: not run; ``WHY`` (required; the rest of the comment) says
  what it needs that a test cannot have (vLLM, another machine's address, ...).
* ``<!-- checked: tests/FILE.py -->``: run or checked by that test file instead (which
  must exist and name the document).
* ``<!-- slow -->``: run, in a test marked ``slow`` (CI runs those too): it takes minutes.
* ``<!-- needs: NAME ... -->``: run only where each ``NAME`` is there: a module (found by
  import spec; missing under ``CI=true`` is a failure, as CI installs every extra) or a path
  relative to the repository root (with a ``/``; missing is a skip naming it).

A block runs in a fresh process whose working directory stands for the repository root
(every top-level entry linked, ``docs/`` copied, so what a block writes stays in a temporary
folder) with ``../shared`` beside it when the checkout has one: Python blocks with this
interpreter, shell blocks with ``bash -e -o pipefail``, ``kvpool`` and ``python`` being this
interpreter's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"bash": "shell", "sh": "shell", "python": "python"}
FAST_TIMEOUT_S = 300
SLOW_TIMEOUT_S = 3600

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--(.*?)-->\s*\Z", re.S)


@dataclass(frozen=True)
class DocBlock:
    document: str  # relative to the repository root
    line: int  # the opening fence's line, from 1
    language: str
    code: str
    marks: dict[str, str]  # mark name -> its argument ('' for none)

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def parse_marks(comment: str) -> dict[str, str]:
    name, _, reason = comment.strip().partition(":")
    if name.strip() == "excerpt":  # the rest is the reason, whatever it holds
        return {"excerpt": reason.strip()}
    marks = {}
    for part in comment.split(";"):
        name, _, argument = part.strip().partition(":")
        if name.strip():
            marks[name.strip()] = argument.strip()
    return marks


def doc_blocks(path: Path, root: Path = ROOT) -> list[DocBlock]:
    """The shell and Python blocks of the document at ``path``, with the marks before each."""
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        language = match.group(1).strip()
        if language not in LANGUAGES:
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        comment = _MARK.search(before) if before.lstrip().startswith("<!--") else None
        marks = parse_marks(comment.group(1)) if comment else {}
        line = text.count("\n", 0, match.start()) + 1
        found.append(DocBlock(str(path.relative_to(root)), line, language, match.group(2), marks))
    return found


BLOCKS = [block for path in DOCUMENTS for block in doc_blocks(path)]
KNOWN_MARKS = {"excerpt", "checked", "slow", "needs"}


def test_every_block_is_found_and_its_marks_are_known():
    assert len(BLOCKS) > 20  # README.md and docs/ hold many; a broken parser finds none
    for block in BLOCKS:
        assert set(block.marks) <= KNOWN_MARKS, f"{block.name}: unknown marks {set(block.marks) - KNOWN_MARKS}"
        if "excerpt" in block.marks:
            assert block.marks["excerpt"], f"{block.name}: an excerpt says why it is not run"
            assert set(block.marks) == {"excerpt"}, f"{block.name}: an excerpt is not run, so takes no other mark"
        if "checked" in block.marks:
            test_file = ROOT / block.marks["checked"]
            assert test_file.is_file(), f"{block.name}: {block.marks['checked']} does not exist"
            assert Path(block.document).name in test_file.read_text(), f"{test_file} never names {block.document}"


# The first words of a command: a block starting so is a shell block, and says so.
_COMMAND = re.compile(r"\A(kvpool|python|pip|vllm|curl|redis-server|[A-Z_]+=\S*) ")


def test_every_command_block_says_it_is_one():
    for path in DOCUMENTS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            if not match.group(1).strip():
                line = text.count("\n", 0, match.start()) + 1
                first = match.group(2).lstrip()
                assert not _COMMAND.match(first), (
                    f"{path.relative_to(ROOT)}:{line}: a command in a ``` block without a language; make it "
                    "```bash (run, or marked as an excerpt)"
                )


def test_the_marks_are_read_from_the_line_before_the_fence(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- excerpt: needs vLLM; and more -->\n```bash\nvllm serve M\n```\n\ntext\n```sh\necho hi\n```\n"
        "<!-- slow; needs: numpy ../shared/x -->\n```python\nprint(1)\n```\n```\nplain\n```\n"
    )
    blocks = doc_blocks(doc, root=tmp_path)
    assert [(b.line, b.language, b.marks) for b in blocks] == [
        (2, "bash", {"excerpt": "needs vLLM; and more"}),
        (7, "sh", {}),
        (11, "python", {"slow": "", "needs": "numpy ../shared/x"}),
    ]


def _missing(block: DocBlock) -> tuple[list[str], list[str]]:
    """(missing modules, missing paths) of the block's ``needs`` mark."""
    modules, paths = [], []
    for name in block.marks.get("needs", "").split():
        if "/" in name:
            if not (ROOT / name).exists():
                paths.append(name)
        elif importlib.util.find_spec(name) is None:
            modules.append(name)
    return modules, paths


def _stand_in_root(tmp_path: Path) -> Path:
    """A folder that looks like the repository root (entries linked, docs/ copied), ../shared beside it."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in {".git", "docs"}:
            continue
        (root / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", root / "docs")
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (tmp_path / "shared").symlink_to(shared)
    return root


# Runs argv[2:] and exits with its status; ends its whole process group once fd argv[1] reads EOF.
_WATCHDOG = """
import os, signal, subprocess, sys, threading
child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
def watch():
    os.read(int(sys.argv[1]), 1)  # returns when the test's end of the pipe closes
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
sys.exit(child.wait())
"""


def run_block(block: DocBlock, tmp_path: Path, timeout: float) -> None:
    modules, paths = _missing(block)
    if modules and os.environ.get("CI") == "true":
        pytest.fail(f"{block.name} needs {', '.join(modules)}, which CI installs")
    if modules or paths:
        pytest.skip(f"{block.name} needs {', '.join(modules + paths)}")
    root = _stand_in_root(tmp_path)
    script = tmp_path / ("block.py" if LANGUAGES[block.language] == "python" else "block.sh")
    script.write_text(block.code)
    if LANGUAGES[block.language] == "python":
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-o", "pipefail", str(script)]
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    # The block runs in a process group of its own under a watchdog that ends the whole group when
    # the pipe from this test closes: when the test ends, and also when this process is killed.
    keep_alive, held = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(keep_alive), *command],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        pass_fds=(keep_alive,),
    )
    os.close(keep_alive)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        os.close(held)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, (
        f"{block.name}: the ```{block.language} block exited with {proc.returncode}\n"
        f"--- block\n{block.code}--- stdout (end)\n{stdout[-3000:]}\n--- stderr (end)\n{stderr[-3000:]}"
    )


RUN = [b for b in BLOCKS if "excerpt" not in b.marks and "checked" not in b.marks]


@pytest.mark.parametrize("block", [b for b in RUN if "slow" not in b.marks], ids=lambda b: b.name)
def test_block_runs(block: DocBlock, tmp_path: Path) -> None:
    run_block(block, tmp_path, FAST_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN if "slow" in b.marks], ids=lambda b: b.name)
def test_slow_block_runs(block: DocBlock, tmp_path: Path) -> None:
    run_block(block, tmp_path, SLOW_TIMEOUT_S)
