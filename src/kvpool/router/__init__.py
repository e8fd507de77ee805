"""``kvpool route``: a prefix-aware router in front of ``kvpool serve`` replicas (the ``serve`` and ``events`` extras).

* :mod:`.index`: block hash -> the replicas that hold it, in memory or in Redis (shared by routers).
* :mod:`.feed`: one replica's KV events (:mod:`kvpool.kv_events`) applied to the index.
* :mod:`.monitor`: health checks; a replica that stops answering leaves rotation and the index.
* :mod:`.replicas`: what the router knows of each replica (up, load, how it hashes blocks).
* :mod:`.prompts`: a request's tokens and block hashes, computed as the replicas compute them.
* :mod:`.app`: the OpenAI front door (Starlette): :class:`Router`, :func:`build_app`.

The choice itself is :mod:`kvpool.routing`'s ``prefix`` rule, shared with the
simulator; tenants and salts are :mod:`kvpool.tenancy`'s. Importing this package
imports neither torch, Starlette, httpx nor ZeroMQ.
"""

from __future__ import annotations

from kvpool.router.front_door import RouteOptions, Router, build_app
from kvpool.router.index import BlockIndex, MemoryIndex, RedisIndex, index_from_url

__all__ = ["BlockIndex", "MemoryIndex", "RedisIndex", "RouteOptions", "Router", "build_app", "index_from_url"]
