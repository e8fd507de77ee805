"""Trace-driven simulation: request traces, synthetic workloads, reference hit rates.

Submodules (imported on demand; this package imports nothing heavy):

* :mod:`kvpool.sim.traces` -- :class:`~kvpool.sim.traces.TraceRequest`, the
  Mooncake and token-level JSONL formats, :func:`~kvpool.sim.traces.load_trace`
  and :func:`~kvpool.sim.traces.write_trace`. Standard library only.
* :mod:`kvpool.sim.workloads` -- seeded synthetic workloads
  (:func:`~kvpool.sim.workloads.generate_workload`). Standard library only.
* :mod:`kvpool.sim.optimum` -- LRU and offline-optimal (Belady/MIN) prefix-cache
  hit rates of a trace. Needs numpy (the ``sim`` extra).
* :mod:`kvpool.sim.sequential` -- replays a trace one request at a time through
  the real manager with a chosen eviction policy
  (:func:`~kvpool.sim.sequential.replay_sequential`). Standard library only.
"""

from __future__ import annotations

__all__: list[str] = []
