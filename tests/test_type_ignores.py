"""Every ``# type: ignore`` in the package names its error code and says why.

An ignore reads ``# type: ignore[code]  # reason``: the code keeps it from
hiding other errors on the line, the reason tells the next reader what mypy
cannot see (``warn_unused_ignores`` drops the ones that stop being needed).
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "kvpool"

IGNORE = re.compile(r"#\s*type:\s*ignore")
WITH_REASON = re.compile(r"# type: ignore\[[a-z0-9-]+(?:, *[a-z0-9-]+)*\]  # \S")


def ignores_without_reason(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each ``type: ignore`` lacking a code or a reason after it."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if IGNORE.search(line) and not WITH_REASON.search(line)
    ]


def test_the_rule_itself():
    assert ignores_without_reason("x = f()  # type: ignore[arg-type]  # the caller checked it") == []
    assert ignores_without_reason("x = f()  # type: ignore[arg-type,operator]  # both checked") == []
    assert ignores_without_reason("x = f()  # type: ignore[arg-type]") == [(1, "x = f()  # type: ignore[arg-type]")]
    assert ignores_without_reason("x = f()  # type: ignore") != []
    assert ignores_without_reason("x = f()  # type: ignore  # no code") != []
    assert ignores_without_reason("x = f()  # type: ignore[arg-type] # one space") != []
    assert ignores_without_reason("x = f()  # type: ignore[arg-type]  #") != []


def test_every_type_ignore_in_src_has_a_reason():
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no sources under {SRC}"
    bad = [
        f"{path.relative_to(SRC.parent.parent)}:{number}: {line}"
        for path in files
        for number, line in ignores_without_reason(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "type: ignore without '[code]  # reason':\n" + "\n".join(bad)
