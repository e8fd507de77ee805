"""The README's promises: its example runs as shown, and CI runs its test command."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_core_example_does_what_its_comments_say():
    """Each commented line is checked: a value comment must equal the expression,
    a ``name == value`` comment must hold after the line runs."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    out = io.StringIO()
    checked = 0
    with contextlib.redirect_stdout(out):
        for line in code.splitlines():
            statement, _, comment = line.partition("#")
            statement, comment = statement.strip(), comment.strip()
            claim = comment.split(":")[0].strip()
            if claim.startswith(("(", "[")) and not statement.startswith("print"):
                assert eval(statement, namespace) == ast.literal_eval(claim), line
                checked += 1
                continue
            exec(statement, namespace)
            if "==" in claim:
                assert eval(claim, namespace), line
                checked += 1
    assert out.getvalue().strip() == "[5, 7, 8, 9, 10, 11, 4, 6, 3, 2, 1]"
    assert checked >= 4


def test_ci_runs_the_readme_test_command():
    setup = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    test_line = [line for line in setup.splitlines() if "pytest" in line][0].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_line in ci
