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
  (:func:`~kvpool.sim.sequential.replay_sequential`); the GPU pool alone (tiers
  need the scheduler: use the simulator). Standard library only.
* :mod:`kvpool.sim.transfers` -- KV tiers in the simulator: the engine's own tier
  connector with a worker that only accounts load and save time over each tier's
  link. Standard library only.
* :mod:`kvpool.sim.simulator` -- replays a trace through the real scheduler and
  manager in simulated time, on one replica or several behind a routing rule
  (:func:`~kvpool.sim.simulator.simulate`). Standard library only.
* :mod:`kvpool.sim.sizing` -- the fewest replicas that meet a time-to-first-token
  objective (:func:`~kvpool.sim.sizing.fewest_replicas`). Standard library only.
* :mod:`kvpool.sim.progress` -- where a study reports its progress: nowhere, or
  plain lines for a stream that is not a terminal. Standard library only.
* :mod:`kvpool.sim.sweep` -- a sweep file's grid of configurations, checked before anything runs
  (:class:`~kvpool.sim.sweep.Sweep`); :mod:`kvpool.sim.sweep_executors` runs its jobs serially, in a
  process pool or on Ray (the ``ray`` extra, imported lazily); :mod:`kvpool.sim.sweep_results` is its
  results file (one JSON line per configuration) and :mod:`kvpool.sim.sweep_runner` the loop that
  resumes and fills it. Standard library only.
* :mod:`kvpool.sim.plots` -- the charts of a replay, a sizing search and a routing
  comparison, as matplotlib figures, PNG or SVG. Needs matplotlib (the ``sim`` extra).
* :mod:`kvpool.sim.report` -- one static HTML page of sections and charts (inline SVG,
  each chart's data beside it as CSV and JSON): ``kvpool simulate --report DIR``.
* :mod:`kvpool.sim.study_charts` -- a study's sections from what ``kvpool simulate
  --json`` prints; :mod:`kvpool.sim.sweep_charts` -- a sweep's, from its result records
  (settings plus the simulate summary). Both need matplotlib.
"""

from __future__ import annotations

__all__: list[str] = []
