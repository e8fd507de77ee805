"""Small stand-ins for ``kvpool serve`` replicas: the same routes, KV events from the real publisher.

A :class:`FakeReplica` tokenizes a chat byte by byte (:class:`ByteTokenizer`, which the
router under test is given too), keeps a set of cached block hashes as a prefix cache
would, publishes each newly cached block with :class:`kvpool.kv_events.KVEventPublisher`,
and answers with ``usage.prompt_tokens_details.cached_tokens`` and its own name. It runs
on a uvicorn server in a thread, and can be killed (the port refuses connections) and
started again on the same ports.

Every server here binds port 0 and reads back the port the system gave it
(:func:`serve_in_thread`), so no other process can take the port between a pick and a bind.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool.events import BlockStored
from kvpool.hashing import BlockHasher
from kvpool.kv_events import KVEventPublisher, describe_events
from kvpool.tenancy import DEFAULT_TENANT, SaltPolicy

BLOCK_SIZE = 16


def bound_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound on the loopback to ``port`` (0: any free port; read it back with ``getsockname``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the port it had
    sock.bind(("127.0.0.1", port))
    return sock


def serve_in_thread(config: uvicorn.Config, port: int = 0) -> tuple[uvicorn.Server, threading.Thread, int]:
    """``config``'s app under uvicorn on a thread, on a socket bound before uvicorn starts: (server, thread, port).

    ``port`` 0 (the default) binds a free port; the port returned is the one bound. The
    call returns once the server accepts connections.
    """
    sock = bound_socket(port)
    bound = int(sock.getsockname()[1])
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), f"the server on port {bound} to start")
    if not server.started:
        sock.close()
        raise AssertionError(f"the server on port {bound} did not start")
    return server, thread, bound


class ByteTokenizer:
    """A chat as the UTF-8 bytes of its messages: deterministic, instant, and shared by replica and router."""

    loaded = True

    def load(self) -> None:
        pass

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())

    def text_tokens(self, prompt: str) -> list[int]:
        return list(prompt.encode())


class FakeReplica:
    """One replica: HTTP on ``port``, KV events on ``events_port`` with replay on ``replay_port``."""

    def __init__(self, name: str, salts: SaltPolicy, *, delay: float = 0.0, admin_key: str | None = None) -> None:
        self.name = name
        self.admin_key = admin_key  # when set, /kv-events needs it (as a replica reached off its loopback)
        self.salts = salts
        self.delay = delay
        # 0 until the first start binds them; a restart binds the same ports again
        self.port, self.events_port, self.replay_port = 0, 0, 0
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.tokenizer = ByteTokenizer()
        self.cached: set[bytes] = set()
        self.served = 0
        self.failed = 0  # generation requests answered ``fail_with``
        self.authorizations: list[str | None] = []  # each generation request's Authorization header
        self.chunk_delay = 0.0  # seconds between streamed chunks
        # When set, a stream stops after its first chunk until the event is set (or its client leaves).
        self.hold_stream: threading.Event | None = None
        self.streams_cut = 0  # streams its client closed before the end
        self.healthy = True  # False: /health answers 503, as a replica that stopped answering in time
        self.fail_with: int | None = None  # when set, each generation request is answered this status at once
        # When set, each generation request is held (after its prompt is counted in ``served``) until the
        # gate opens: tests then know exactly how many requests are in flight, whatever the machine's load.
        self.gate: threading.Event | None = None
        self.publisher: KVEventPublisher | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeReplica:
        self.cached.clear()  # a new process: an empty cache, sequence numbers from 0
        self.publisher = KVEventPublisher(f"tcp://*:{self.events_port}", replay_endpoint=f"tcp://*:{self.replay_port}")
        self.events_port = _port_of(self.publisher.endpoint)
        assert self.publisher.replay_endpoint is not None
        self.replay_port = _port_of(self.publisher.replay_endpoint)
        config = uvicorn.Config(
            self._app(), host="127.0.0.1", port=self.port, log_level="warning", access_log=False, lifespan="off"
        )
        self._server, self._thread, self.port = serve_in_thread(config, self.port)
        return self

    def kill(self) -> None:
        """Stop answering at once: open connections dropped, the port refused, the event sockets closed."""
        assert self._server is not None and self._thread is not None and self.publisher is not None
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(10)
        self.publisher.close()

    def _answer(self, body: dict[str, Any], tenant: str) -> tuple[int, int]:
        """Serve the prompt: count its cached blocks, cache the rest and publish them."""
        if "messages" in body:
            tokens = self.tokenizer.chat_tokens(body["messages"])
        else:
            tokens = self.tokenizer.text_tokens(body["prompt"])
        hashes = self.hasher.hash_token_ids(tokens, cache_salt=self.salts.cache_salt(tenant, body.get("cache_salt")))
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cached:
            hit += 1
        new = hashes[hit:]
        if new:
            self.cached.update(new)
            assert self.publisher is not None
            self.publisher.publish(
                [
                    BlockStored(
                        block_hashes=tuple(new),
                        parent_block_hash=hashes[hit - 1] if hit else None,
                        token_ids=tuple(tokens[hit * BLOCK_SIZE : len(hashes) * BLOCK_SIZE]),
                        block_size=BLOCK_SIZE,
                        lora_name=None,
                        extra_keys=(None,) * len(new),
                    )
                ]
            )
        self.served += 1
        return len(tokens), hit * BLOCK_SIZE

    def _app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            self.authorizations.append(request.headers.get("authorization"))
            if self.fail_with is not None:
                self.failed += 1
                return JSONResponse({"error": {"message": f"{self.name} fails"}}, status_code=self.fail_with)
            body = json.loads(await request.body())
            prompt_tokens, cached = self._answer(body, DEFAULT_TENANT)
            if self.delay:
                await asyncio.sleep(self.delay)
            while self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.01)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 1,
                "total_tokens": prompt_tokens + 1,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            if not body.get("stream"):
                return JSONResponse({"object": "chat.completion", "replica": self.name, "usage": usage})

            async def events() -> AsyncIterator[bytes]:
                for part in (self.name, " says", " hi"):
                    yield f"data: {json.dumps({'choices': [{'delta': {'content': part}}]})}\n\n".encode()
                    await asyncio.sleep(self.chunk_delay)
                    while self.hold_stream is not None and not self.hold_stream.is_set():
                        await asyncio.sleep(0.01)
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

            async def counted() -> AsyncIterator[bytes]:
                complete = False
                try:
                    async for chunk in events():
                        yield chunk
                    complete = True
                finally:
                    self.streams_cut += not complete

            return StreamingResponse(counted(), media_type="text/event-stream")

        async def health(request: Request) -> Response:
            return JSONResponse(
                {"status": "ok" if self.healthy else "stalled"}, status_code=200 if self.healthy else 503
            )

        async def kv_events(request: Request) -> Response:
            assert self.publisher is not None
            if self.admin_key and request.headers.get("authorization") != f"Bearer {self.admin_key}":
                return JSONResponse({"error": {"message": "this route needs an admin key"}}, status_code=401)
            return JSONResponse(
                describe_events(
                    self.hasher, endpoint=self.publisher.endpoint, replay_endpoint=self.publisher.replay_endpoint
                )
            )

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.name}]})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/kv-events", kv_events, methods=["GET"]),
            ]
        )


def _port_of(endpoint: str) -> int:
    """The port of a bound ``tcp://HOST:PORT`` endpoint."""
    return int(endpoint.rpartition(":")[2])


def wait_for(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class RouterThread:
    """A :class:`kvpool.router.Router` served by uvicorn on a thread, and an HTTP client for it."""

    def __init__(self, router: Any) -> None:
        from kvpool.router import build_app

        self.router = router
        config = uvicorn.Config(build_app(router), host="127.0.0.1", port=0, log_level="warning")
        self._server, self._thread, self.port = serve_in_thread(config)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def chat(self, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json={"model": "fake", "messages": messages, **extra})

    def stop(self) -> None:
        self.client.close()
        self._server.should_exit = True
        self._thread.join(10)
