"""A hostile Redis: a TCP proxy in front of a real redis-server that slows, stalls, garbles or drops its replies.

Commands pass through unchanged; replies are framed (RESP2 and RESP3) and each is paired with the
command it answers, then treated as the :class:`Hostility` says:

* ``delay_ms``: each reply is held that long, one after another on a connection (a pipeline of 16
  replies takes 16 times as long): a server that takes a fixed time per reply;
* ``latency_ms``: each reply is held until that long after it arrived from the server, so the
  replies of one pipeline travel together (a pipeline of 16 takes about as long as one): a server
  far away;
* ``trickle``: each reply is sent ``trickle_bytes`` at a time with ``trickle_pause_ms`` between
  the pieces (default one byte per millisecond): a reply that keeps arriving, never stalling long
  enough for a socket timeout;
* ``stall_after``: after that many replies the proxy answers nothing more, on any connection, old
  or new, and keeps every connection open: a server that hangs;
* ``garbage``: replies are replaced, ``"bytes"`` by bytes that are not RESP at all, ``"payload"`` by
  the same reply with every bulk string's bytes flipped (valid RESP, wrong content);
* ``drop_after``: after that many replies the proxy closes every connection, and closes each new
  one at once: a server that disappears.

``count_only`` (command names, e.g. ``{"GETRANGE"}``) narrows which replies are counted and treated:
with it, ``stall_after=1`` stalls at the second read of block values rather than during the
client's connection handshake (the store's read script counts as the GETRANGEs it runs: one reply
for a run of up to 16 blocks). Once a stall or drop has happened it applies to every reply.

As a library (tests import it as the benchmarks' smoke tests do, with ``benchmarks/`` on ``sys.path``)::

    with ThrottledRedis("unix:///tmp/redis.sock", Hostility(delay_ms=50)) as proxy:
        store = open_store(proxy.url, codec)     # redis://127.0.0.1:<port>/0

As a command (prints its URL, serves until interrupted)::

    python benchmarks/throttled_redis.py --upstream redis://127.0.0.1:6379 --delay-ms 50

The upstream is ``redis://[:PASSWORD@]HOST:PORT[/DB]`` or ``unix:///PATH[?db=N]``; the proxy's own URL
keeps the upstream's password and database, so a client pointed at it sees the same server. TLS
(``rediss://``) is refused: the proxy reads the bytes it forwards. Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

__all__ = ["GARBAGE_KINDS", "Hostility", "ThrottledRedis", "Upstream", "reply_end"]

GarbageKind = Literal["bytes", "payload"]
GARBAGE_KINDS: tuple[GarbageKind, ...] = ("bytes", "payload")
#: What ``garbage="bytes"`` sends instead of a reply: no RESP reply starts with ``?``, so a client fails at once.
NOT_RESP = b"?kvpool throttled_redis: garbage\r\n"

_SIMPLE = frozenset(b"+-:_,#(")  # one line: simple string, error, integer, null, double, boolean, big number
_BULK = frozenset(b"$=!")  # a length line, then that many bytes and CRLF: bulk string, verbatim, bulk error
_AGGREGATE = frozenset(b"*~>")  # a count line, then that many replies: array, set, push
_COUNTED = _BULK | _AGGREGATE | frozenset(b"%|")  # a length or count line: the above, maps and attributes


class NotResp(ValueError):
    """Bytes that cannot be the start of a RESP reply (names what was found)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hostility:
    """How the proxy treats the replies it counts (see the module docstring). The default forwards all."""

    delay_ms: float = 0.0
    latency_ms: float = 0.0
    trickle: bool = False
    trickle_bytes: int = 1
    trickle_pause_ms: float = 1.0
    stall_after: int | None = None
    garbage: GarbageKind | None = None
    drop_after: int | None = None
    count_only: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("delay_ms", "latency_ms", "trickle_pause_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name} must be a number of milliseconds >= 0, got {value!r}")
        for name, least in (("trickle_bytes", 1), ("stall_after", 0), ("drop_after", 0)):
            value = getattr(self, name)
            if value is None and name != "trickle_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.stall_after is not None and self.drop_after is not None:
            raise ValueError(
                f"stall_after ({self.stall_after}) and drop_after ({self.drop_after}) cannot both be set: "
                "a server either hangs or disappears"
            )
        if self.garbage is not None and self.garbage not in GARBAGE_KINDS:
            raise ValueError(f"garbage must be one of {', '.join(GARBAGE_KINDS)}, got {self.garbage!r}")
        if self.count_only is not None:
            if isinstance(self.count_only, str) or not all(isinstance(n, str) and n for n in self.count_only):
                raise ValueError(f"count_only must be a set of command names, got {self.count_only!r}")
            object.__setattr__(self, "count_only", frozenset(n.upper() for n in self.count_only))

    @property
    def ends_after(self) -> int | None:
        """The number of counted replies after which the server stalls or disappears (None: never)."""
        return self.stall_after if self.stall_after is not None else self.drop_after

    def counts(self, command: bytes) -> bool:
        return self.count_only is None or command.decode("latin-1").upper() in self.count_only


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where the real Redis is, and the parts of its URL a client of the proxy needs (password, database)."""

    host: str | None
    port: int | None
    path: str | None
    userinfo: str
    db: str

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"upstream {url!r} names no socket path (unix:///PATH)")
            db = dict(parse_qsl(parts.query)).get("db", "0")
            userinfo = parts.netloc.rpartition("@")[0]
            return cls(None, None, parts.path, userinfo + "@" if userinfo else "", db)
        if parts.scheme != "redis":
            raise ValueError(f"upstream {url!r} must be redis://HOST:PORT[/DB] or unix:///PATH (no TLS: rediss)")
        if not parts.hostname:
            raise ValueError(f"upstream {url!r} names no host")
        try:
            port = parts.port or 6379
        except ValueError as exc:
            raise ValueError(f"upstream {url!r} has a bad port: {exc}") from exc
        userinfo = parts.netloc.rpartition("@")[0]
        return cls(parts.hostname, port, None, userinfo + "@" if userinfo else "", parts.path.strip("/") or "0")

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.path is not None:
            return await asyncio.open_unix_connection(self.path)
        return await asyncio.open_connection(self.host, self.port)

    def proxy_url(self, port: int) -> str:
        return f"redis://{self.userinfo}127.0.0.1:{port}/{self.db}"


# -- RESP framing -------------------------------------------------------------------------


def reply_end(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """Where the one RESP reply starting at ``pos`` ends; None while it is incomplete; NotResp if it is not RESP."""
    pending = 1  # replies still to read: an aggregate adds its elements
    while pending:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        kind, head = buf[pos], bytes(buf[pos + 1 : line_end])
        pos = line_end + 2
        pending -= 1
        if kind in _SIMPLE:
            continue
        if kind not in _COUNTED:
            raise NotResp(f"no RESP reply starts with {chr(kind)!r}")
        try:
            n = int(head)
        except ValueError:
            raise NotResp(f"RESP type {chr(kind)!r} needs a length, got {head[:40]!r}") from None
        if kind in _BULK:
            if n >= 0:
                if len(buf) < pos + n + 2:
                    return None
                pos += n + 2
        elif kind in _AGGREGATE:
            pending += max(n, 0)
        elif kind == ord("%"):  # a map: n keys and n values
            pending += 2 * max(n, 0)
        else:  # "|", attributes: n pairs, then the reply they describe
            pending += 2 * max(n, 0) + 1
    return pos


def command_name(frame: bytes) -> bytes:
    """The command a client's request names: the first bulk string of its array, or an inline command's first word."""
    if frame[:1] == b"*":
        head_end = frame.find(b"\r\n")
        length_end = frame.find(b"\r\n", head_end + 2)
        if length_end < 0 or frame[head_end + 2 : head_end + 3] != b"$":
            return b""
        n = int(frame[head_end + 3 : length_end])
        return frame[length_end + 2 : length_end + 2 + n]
    words = frame.split(None, 1)
    return words[0] if words else b""


def _bulk_strings(frame: bytes, count: int) -> list[bytes]:
    """The first ``count`` bulk strings of a RESP array request (fewer where it has fewer)."""
    out: list[bytes] = []
    pos = frame.find(b"\r\n") + 2
    while len(out) < count and frame[pos : pos + 1] == b"$":
        length_end = frame.find(b"\r\n", pos)
        n = int(frame[pos + 1 : length_end])
        out.append(frame[length_end + 2 : length_end + 2 + n])
        pos = length_end + 2 + n + 2
    return out


def _script_commands() -> dict[bytes, bytes]:
    """The redis tier's scripts by SHA1 (lowercase hex), each as the command it runs on every key."""
    from kvpool.tiers.redis_store import LOOKUP_SCRIPT, READ_SCRIPT

    return {
        hashlib.sha1(s.encode()).hexdigest().encode(): c
        for s, c in ((LOOKUP_SCRIPT, b"STRLEN"), (READ_SCRIPT, b"GETRANGE"))
    }


_SCRIPTS = _script_commands()


def counted_name(frame: bytes) -> bytes:
    """What a request counts as: its command, or for the redis tier's scripts the command they run on each key
    (EVALSHA of the read script counts as GETRANGE, so ``count_only`` names reads however they are sent)."""
    name = command_name(frame)
    if name.upper() in (b"EVALSHA", b"EVAL") and frame[:1] == b"*":
        body = _bulk_strings(frame, 2)[1:]
        sha = body[0].lower() if name.upper() == b"EVALSHA" and body else None
        if name.upper() == b"EVAL" and body:
            sha = hashlib.sha1(body[0]).hexdigest().encode()
        return _SCRIPTS.get(sha or b"", name)
    return name


def request_end(buf: bytes | bytearray, pos: int) -> int | None:
    """Where the client's request starting at ``pos`` ends: a RESP array, or an inline command's line."""
    if buf[pos : pos + 1] == b"*":
        return reply_end(buf, pos)
    line_end = buf.find(b"\n", pos)
    return None if line_end < 0 else line_end + 1


def flip_bulk_strings(reply: bytes) -> bytes:
    """The same reply with the bytes of every bulk string flipped (XOR 0x55): valid RESP, wrong content."""
    out = bytearray()
    pos = 0
    while pos < len(reply):
        line_end = reply.index(b"\r\n", pos)
        kind, head = reply[pos], reply[pos + 1 : line_end]
        out += reply[pos : line_end + 2]
        pos = line_end + 2
        if kind in _BULK and int(head) >= 0:
            n = int(head)
            out += bytes(b ^ 0x55 for b in reply[pos : pos + n]) + b"\r\n"
            pos += n + 2
    return bytes(out)


# -- the proxy ----------------------------------------------------------------------------


class ThrottledRedis:
    """The proxy, serving on a loopback port of its own (port 0, read back) from a thread of its own.

    Use it as a context manager (``with ThrottledRedis(...) as proxy: proxy.url``) or call
    :meth:`start` and :meth:`close`. ``replies`` counts the replies it counted (``count_only``);
    ``ended`` is set once it has stalled or dropped its connections, so a test can check that the
    hostile path was taken without timing anything.
    """

    def __init__(self, upstream: str, hostility: Hostility | None = None) -> None:
        self.upstream = Upstream.parse(upstream)
        self.hostility = hostility or Hostility()
        self.replies = 0
        self.ended = threading.Event()
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._startup_error: BaseException | None = None

    def __enter__(self) -> ThrottledRedis:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> ThrottledRedis:
        if self._thread is not None:
            raise RuntimeError("this proxy is already started")
        self._thread = threading.Thread(target=self._serve_forever, name="throttled-redis", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        return self

    def close(self) -> None:
        """Close every connection and stop serving; the thread is gone when this returns."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._loop = self._thread = None

    # -- on the proxy's thread --------------------------------------------------------------

    def _serve_forever(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
            self.url = self.upstream.proxy_url(self._server.sockets[0].getsockname()[1])
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that called start()
            self._startup_error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self.ended.is_set() and self.hostility.drop_after is not None:
            writer.close()  # the server is gone
            return
        try:
            up_reader, up_writer = await self.upstream.connect()
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        commands: deque[bytes] = deque()
        pumps = [
            asyncio.ensure_future(self._requests(reader, up_writer, commands)),
            asyncio.ensure_future(self._replies(up_reader, writer, commands)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the proxy is closing: this connection ends with it
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def _requests(
        self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, commands: deque[bytes]
    ) -> None:
        """Forward the client's bytes as they are, noting the command each request names."""
        buf = bytearray()
        while chunk := await reader.read(1 << 16):
            buf += chunk
            pos = 0
            while pos < len(buf) and (end := request_end(buf, pos)) is not None:
                commands.append(counted_name(bytes(buf[pos:end])))
                pos = end
            del buf[:pos]
            up_writer.write(chunk)
            await up_writer.drain()

    async def _replies(
        self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, commands: deque[bytes]
    ) -> None:
        buf = bytearray()
        loop = asyncio.get_running_loop()
        while chunk := await up_reader.read(1 << 16):
            arrived = loop.time()
            buf += chunk
            pos = 0
            while pos < len(buf) and (end := reply_end(buf, pos)) is not None:
                reply = bytes(buf[pos:end])
                pos = end
                command = commands.popleft() if commands else b""
                if not await self._answer(reply, command, writer, arrived):
                    return
            del buf[:pos]

    async def _answer(self, reply: bytes, command: bytes, writer: asyncio.StreamWriter, arrived: float) -> bool:
        """Send one reply (whose last bytes came at loop time ``arrived``) as the hostility says; False: close."""
        h = self.hostility
        if self.ended.is_set():
            return h.drop_after is None  # stalled: swallow it and keep the connection; dropped: close
        # a script's first call answering NOSCRIPT (then it is loaded) is no block read, whatever it counts as
        if not h.counts(command) or (h.count_only is not None and reply.startswith(b"-NOSCRIPT")):
            writer.write(reply)
            await writer.drain()
            return True
        if h.ends_after is not None and self.replies >= h.ends_after:
            self._end()
            return h.drop_after is None
        self.replies += 1
        if h.garbage == "bytes":
            reply = NOT_RESP
        elif h.garbage == "payload":
            reply = flip_bulk_strings(reply)
        if h.latency_ms:
            await asyncio.sleep(max(0.0, arrived + h.latency_ms / 1000 - asyncio.get_running_loop().time()))
        if h.delay_ms:
            await asyncio.sleep(h.delay_ms / 1000)
        if not h.trickle:
            writer.write(reply)
            await writer.drain()
            return True
        for start in range(0, len(reply), h.trickle_bytes):
            writer.write(reply[start : start + h.trickle_bytes])
            await writer.drain()
            if h.trickle_pause_ms:
                await asyncio.sleep(h.trickle_pause_ms / 1000)
        return True

    def _end(self) -> None:
        self.ended.set()
        if self.hostility.drop_after is not None:
            for writer in list(self._writers):
                writer.close()


def hostility_from_args(args: argparse.Namespace) -> Hostility:
    return Hostility(
        delay_ms=args.delay_ms, latency_ms=args.latency_ms, trickle=args.trickle, trickle_bytes=args.trickle_bytes,
        trickle_pause_ms=args.trickle_pause_ms, stall_after=args.stall_after, garbage=args.garbage,
        drop_after=args.drop_after, count_only=frozenset(args.count_only) if args.count_only else None,
    )  # fmt: skip


def add_hostility_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delay-ms", type=float, default=0.0, help="hold each reply this long, one after another")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="hold each reply this long after it came")
    parser.add_argument("--trickle", action="store_true", help="send each reply a few bytes at a time")
    parser.add_argument("--trickle-bytes", type=int, default=1, help="bytes per piece when trickling [1]")
    parser.add_argument("--trickle-pause-ms", type=float, default=1.0, help="pause between pieces [1 ms]")
    parser.add_argument("--stall-after", type=int, default=None, help="answer this many replies, then nothing")
    parser.add_argument(
        "--garbage", nargs="?", const="bytes", choices=GARBAGE_KINDS, default=None,
        help="replace replies: bytes that are not RESP (bytes, the default) or flipped bulk strings (payload)",
    )  # fmt: skip
    parser.add_argument("--drop-after", type=int, default=None, help="answer this many replies, then close")
    parser.add_argument("--count-only", action="append", metavar="COMMAND", help="count and treat only these")


def main(argv: list[str] | None = None, *, serve: Callable[[ThrottledRedis], None] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="redis://HOST:PORT[/DB] or unix:///PATH")
    add_hostility_flags(parser)
    args = parser.parse_args(argv)
    try:
        hostility = hostility_from_args(args)
        proxy = ThrottledRedis(args.upstream, hostility)
    except ValueError as exc:
        parser.error(str(exc))
    with proxy:
        print(proxy.url, flush=True)
        if serve is not None:
            serve(proxy)
            return
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
