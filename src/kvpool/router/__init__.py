"""``kvpool route``: a prefix-aware router in front of ``kvpool serve`` replicas (the ``serve`` and ``events`` extras).

* :mod:`.index`: block hash -> the replicas that hold it, in memory or in Redis (shared by routers).
* :mod:`.feed`: one replica's KV events (:mod:`kvpool.kv_events`) applied to the index.
* :mod:`.monitor`: health checks; a replica that stops answering leaves rotation and the index.
* :mod:`.replicas`: what the router knows of each replica (up, load, how it hashes blocks).
* :mod:`.prompt_hashes`: a request's tokens and block hashes, computed as the replicas compute them.
* :mod:`.route_options`: :class:`RouteOptions`, what ``kvpool route`` is told, checked.
* :mod:`.ranking`: a prompt keyed, and the replicas in the order to try them.
* :mod:`.bookkeeping`: what each request routed leaves noted (in flight, blocks computing, predictions).
* :mod:`.relay`: a request sent on to a replica and its answer streamed back, with retries.
* :mod:`.front_door`: the OpenAI front door (Starlette): :class:`Router` (a facade over the above),
  :func:`build_app`.

The choice itself is :mod:`kvpool.routing`'s ``prefix`` rule, shared with the
simulator; tenants and salts are :mod:`kvpool.tenancy`'s. Importing this package
imports neither torch, Starlette, httpx nor ZeroMQ.
"""

from __future__ import annotations

from kvpool.router.front_door import RouteOptions, Router, build_app
from kvpool.router.index import BlockIndex, MemoryIndex, RedisIndex, index_from_url

__all__ = ["BlockIndex", "MemoryIndex", "RedisIndex", "RouteOptions", "Router", "build_app", "index_from_url"]
