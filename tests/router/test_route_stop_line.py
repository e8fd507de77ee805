"""``kvpool route`` says when it stops (issue 30), on SIGTERM and on Ctrl-C, after it shut down."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import pytest

CODE = "import sys; from kvpool.cli.commands import cli; sys.exit(cli.main({args!r}, prog_name='kvpool'))"


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, None)])
def test_the_router_logs_a_line_when_it_stops(sig: signal.Signals, status: int | None) -> None:
    args = ["route", "--port", "0", "--replica", "http://127.0.0.1:1", "--no-tenant-isolation"]
    proc = subprocess.Popen([sys.executable, "-c", CODE.format(args=args)], stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while (line := lines.get(timeout=120)) is not None and "routing on " not in line:
            pass
        assert line is not None, f"the router exited with {proc.wait()} before listening"
        url = line.split("routing on ", 1)[1]
        proc.send_signal(sig)
        rest = []
        while (line := lines.get(timeout=120)) is not None:
            rest.append(line)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=60)
    assert any(line.endswith(f"stopped routing on {url}") for line in rest), rest
    if status is not None:
        assert code == status
