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
  (:func:`~kvpool.sim.sequential.replay_sequential`), with or without offload
  tiers. Standard library only.
* :mod:`kvpool.sim.tiers` -- offload tiers below a pool: LRU stores of block
  hashes with a load bandwidth and latency, and the manager that spills into
  them and loads from them. Standard library only.
* :mod:`kvpool.sim.simulator` -- replays a trace through the real scheduler and
  manager in simulated time, on one replica or several behind a routing rule
  (:func:`~kvpool.sim.simulator.simulate`). Standard library only.
* :mod:`kvpool.sim.sizing` -- the fewest replicas that meet a time-to-first-token
  objective (:func:`~kvpool.sim.sizing.fewest_replicas`). Standard library only.
* :mod:`kvpool.sim.plots` -- PNG plots of a replay. Needs matplotlib (the ``sim``
  extra).
"""

from __future__ import annotations

__all__: list[str] = []
