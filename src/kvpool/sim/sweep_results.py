"""A sweep's results file: one JSON line per finished configuration, written as each finishes.

Each line carries the job's place in the grid, its configuration and its key (a digest of every
option it ran with), then its figures::

    {"index": 3, "key": "9f...", "config": {"replicas": 2, "routing": "prefix"}, "figures": {...}}

Lines are appended and flushed as jobs finish, in whatever order they finish, so a sweep that is
stopped keeps every configuration it finished; :func:`read_results` gives them back in grid order.
A rerun over the same file skips the jobs whose key it already holds. A last line cut short (the
sweep stopped while writing it) is not a result: it is ignored, and the job runs again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from kvpool.errors import ConfigError
from kvpool.sim.sweep import SweepJob

__all__ = ["DEFAULT_SWEEP_OUT", "SweepResults", "read_results"]

#: Where a sweep's results go when ``--sweep-out`` is not given: beside the sweep file, named after it.
DEFAULT_SWEEP_OUT = "{stem}.results.jsonl"


def _records(path: Path) -> list[dict[str, Any]]:
    """The whole lines of ``path`` that are results; a line cut short at the end is dropped."""
    if not path.exists():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--sweep-out {str(path)!r} cannot be read: {exc}") from None
    lines = text.split("\n")[:-1]  # a last line with no newline was cut short: that job runs again
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not {"index", "key", "config", "figures"} <= set(record):
            raise ConfigError(f"--sweep-out {str(path)!r} line {number} is not a sweep result")
        records.append(record)
    return records


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Every result in ``path``, in grid order (by ``index``), whatever order the jobs finished in."""
    return sorted(_records(Path(path)), key=lambda r: (r["index"], r["key"]))


class SweepResults:
    """The results file of one sweep, open for appending; :meth:`done` says which jobs it already holds."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        records = _records(self.path)
        self._done = {r["key"] for r in records}
        self._stream: TextIO | None = None

    def _open(self) -> TextIO:
        """The file for appending, a line cut short at its end dropped first."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab+") as f:
            f.seek(0)
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
        return self.path.open("a", encoding="utf-8")

    def done(self, job: SweepJob) -> bool:
        return job.key in self._done

    def append(self, job: SweepJob, figures: dict[str, Any]) -> None:
        """Write ``job``'s line and flush it, so it survives a stop."""
        if self._stream is None:
            try:
                self._stream = self._open()
            except OSError as exc:
                raise ConfigError(f"--sweep-out {str(self.path)!r} cannot be written: {exc.strerror or exc}") from None
        record = {"index": job.index, "key": job.key, "config": job.config.to_json(), "figures": figures}
        self._stream.write(json.dumps(record, sort_keys=True) + "\n")
        self._stream.flush()
        self._done.add(job.key)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
