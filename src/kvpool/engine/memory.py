"""How much memory the KV cache may take: what the process can observe, and the budget formula.

::

    KV budget = total x utilization - weights - peak activations - other

* CUDA: ``total`` is the device's memory (``torch.cuda.mem_get_info``),
  ``weights`` the allocator's growth while loading, the peak from
  ``reset_peak_memory_stats`` / ``max_memory_allocated`` around the profile
  pass, and ``other`` the memory in use outside torch's allocator (CUDA
  context, libraries, other processes). Measured.
* CPU: ``total`` is what the process could hold when startup began (its
  resident set plus ``MemAvailable`` from ``/proc/meminfo``), ``weights`` the
  bytes of the parameters and buffers, the peak the growth of the peak
  resident set (``VmHWM``, reset through ``/proc/self/clear_refs``, after
  glibc's ``malloc_trim`` has returned free heap pages) during the profile
  pass, and ``other`` the resident set before loading (interpreter and
  libraries). The allocator may still reuse memory it holds and other threads
  may allocate meanwhile, so the peak is an estimate, and the result
  is capped at :data:`CPU_KV_CACHE_CAP_BYTES`: host memory is shared with
  everything else on the machine.

An explicit ``kv_cache_memory`` replaces the formula.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from kvpool.checks import format_bytes
from kvpool.errors import ConfigError
from kvpool.planner import GiB

__all__ = [
    "CPU_KV_CACHE_CAP_BYTES",
    "MemoryBaseline",
    "MemoryProfile",
    "MemorySource",
    "describe_budget",
    "format_bytes",
    "host_available_bytes",
    "kv_budget",
    "measure_peak",
    "weights_bytes",
]

#: Largest KV cache the CPU path picks by itself (pass ``kv_cache_memory`` for more).
CPU_KV_CACHE_CAP_BYTES = 4 * GiB


class MemorySource(Enum):
    """How the KV cache budget was obtained."""

    CUDA_MEASURED = "measured with torch.cuda memory statistics"
    CPU_ESTIMATED = "estimated from the process's resident set (/proc/self/status)"
    GIVEN = "given (kv_cache_memory)"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryProfile:
    """The memory picture at startup, in bytes.

    ``total_bytes`` and ``other_bytes`` are None where the platform does not
    tell (no ``/proc``); ``peak_activation_bytes`` is None when the peak could
    not be observed. ``capped`` says the CPU cap lowered the budget.
    """

    source: MemorySource
    total_bytes: int | None
    utilization: float
    weights_bytes: int
    peak_activation_bytes: int | None
    other_bytes: int | None
    profile_tokens: int
    profile_seconds: float
    kv_budget_bytes: int
    capped: bool = False


# -- what the process can observe ---------------------------------------------------------


def _read_kib(path: str, field: str) -> int | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return None if match is None else int(match.group(1)) * 1024


def host_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``: what the system could still give."""
    return _read_kib("/proc/meminfo", "MemAvailable")


def _rss_bytes() -> int | None:
    return _read_kib("/proc/self/status", "VmRSS")


def _peak_rss_bytes() -> int | None:
    return _read_kib("/proc/self/status", "VmHWM")


def _release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``), where there is one.

    Otherwise a pass reuses pages freed earlier (while loading, say) and its
    peak hardly shows in the resident set.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> bool:
    """Set the peak resident set back to the current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class MemoryBaseline:
    """The memory picture before the weights are loaded."""

    device: torch.device
    resident_bytes: int | None  # CPU: the process's resident set
    available_bytes: int | None  # CPU: MemAvailable
    allocated_bytes: int | None  # CUDA: torch's allocated bytes

    @classmethod
    def capture(cls, device: torch.device) -> MemoryBaseline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return cls(device, None, None, torch.cuda.memory_allocated(device))
        return cls(device, _rss_bytes(), host_available_bytes(), None)


def weights_bytes(model: torch.nn.Module, baseline: MemoryBaseline) -> int:
    """CUDA: the allocator's growth since ``baseline``; CPU: parameter and buffer bytes."""
    if baseline.device.type == "cuda":
        torch.cuda.synchronize(baseline.device)
        return torch.cuda.memory_allocated(baseline.device) - (baseline.allocated_bytes or 0)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


def measure_peak(device: torch.device, work: Callable[[], object]) -> int | None:
    """Bytes ``work`` needed at its peak beyond what was in use before it (None: not observable)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    _release_free_heap()
    reset = _reset_peak_rss()
    before = _rss_bytes()
    work()
    high = _peak_rss_bytes()
    if not reset or before is None or high is None:
        return None
    return max(high - before, 0)


# -- the budget ------------------------------------------------------------------------------


def kv_budget(
    *,
    baseline: MemoryBaseline,
    utilization: float,
    weights: int,
    peak: int | None,
    given: int | None,
    profile_tokens: int,
    profile_seconds: float,
) -> MemoryProfile:
    """Apply the formula of the module docstring (or take ``given`` bytes).

    Raises:
        ConfigError: nothing is left for the KV cache, or the platform does not
            show enough to measure and no budget was given.
    """
    device = baseline.device
    total: int | None
    other: int | None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        other = max((total - free) - torch.cuda.memory_reserved(device), 0)
        source = MemorySource.CUDA_MEASURED
    else:
        resident, available = baseline.resident_bytes, baseline.available_bytes
        total = None if resident is None or available is None else resident + available
        other = resident
        source = MemorySource.CPU_ESTIMATED

    def profile(source: MemorySource, kv_budget_bytes: int, capped: bool = False) -> MemoryProfile:
        return MemoryProfile(
            source=source,
            kv_budget_bytes=kv_budget_bytes,
            capped=capped,
            total_bytes=total,
            utilization=float(utilization),
            weights_bytes=weights,
            peak_activation_bytes=peak,
            other_bytes=other,
            profile_tokens=profile_tokens,
            profile_seconds=profile_seconds,
        )

    if given is not None:
        return profile(MemorySource.GIVEN, given)
    if total is None or other is None or peak is None:
        raise ConfigError("cannot measure the memory left for the KV cache on this platform; pass kv_cache_memory")
    budget = int(total * utilization) - weights - peak - other
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {format_bytes(total)} x {utilization} - weights {format_bytes(weights)} "
            f"- activations {format_bytes(peak)} - other {format_bytes(other)} = {format_bytes(budget)}; "
            "raise gpu_memory_utilization or pass kv_cache_memory"
        )
    capped = device.type == "cpu" and budget > CPU_KV_CACHE_CAP_BYTES
    return profile(source, CPU_KV_CACHE_CAP_BYTES if capped else budget, capped)


def describe_budget(memory: MemoryProfile) -> str:
    """How the budget came about, for the startup log."""
    if memory.source is MemorySource.GIVEN:
        return "given"
    text = (
        f"{format_bytes(memory.total_bytes or 0)} x {memory.utilization:g} - weights "
        f"{format_bytes(memory.weights_bytes)} - activations {format_bytes(memory.peak_activation_bytes or 0)} "
        f"- other {format_bytes(memory.other_bytes or 0)}"
    )
    if memory.source is MemorySource.CPU_ESTIMATED:
        text += "; CPU estimate"
        if memory.capped:
            text += f", capped at {format_bytes(CPU_KV_CACHE_CAP_BYTES)} (pass kv_cache_memory for more)"
    return text
