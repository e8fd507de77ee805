"""The matrix product behind every projection: which kernel computes ``x @ W.T + b``.

A step of a small model on a CPU is mostly weight products (q/k/v, output, gate/up,
down and the LM head), and torch's ``F.linear`` in fp32 goes to its BLAS (MKL in the
CPU wheel). On an AMD EPYC that path reads the weights well below the memory
bandwidth oneDNN's inner-product kernel reaches on the same matrices: one decode step
of SmolLM2-135M spent 36.5 ms in the layers' products and 9.9 ms in the head through
``F.linear``, against 22.9 and 3.9 ms through oneDNN, on the same weights in the same
layout (2 threads; BENCHMARKS.md, "Engine: the weight products on oneDNN"). oneDNN is reached
through ``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler emits for
CPU linears; it takes the weight as stored, so nothing is copied or repacked.

``select_linear_kernel`` picks oneDNN for fp32 on a CPU where the op exists and agrees
with ``F.linear`` on a probe, and ``F.linear`` everywhere else; either can be asked for.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpool.errors import ConfigError

__all__ = ["LinearFn", "LinearKernel", "linear_function", "select_linear_kernel"]

#: ``(x [T, in], weight [out, in], bias [out] or None) -> [T, out]``
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class LinearKernel(enum.Enum):
    """Which kernel computes the engine's projections."""

    #: ``torch.nn.functional.linear``: the device's BLAS (MKL on CPU wheels, cuBLAS on CUDA).
    TORCH = "torch"
    #: oneDNN's inner product through torch (CPU, float32 and bfloat16).
    ONEDNN = "onednn"

    @classmethod
    def parse(cls, kind: LinearKernel | str) -> LinearKernel:
        """``kind`` as a kernel.

        Raises:
            ConfigError: ``kind`` names no kernel.
        """
        if isinstance(kind, LinearKernel):
            return kind
        try:
            return cls(kind)
        except (ValueError, TypeError):
            known = ", ".join(k.value for k in cls)
            raise ConfigError(f"unknown linear kernel {kind!r}; known: {known}") from None


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def linear_function(kernel: LinearKernel) -> LinearFn:
    """The callable that computes a projection with ``kernel``."""
    return _onednn_linear if kernel is LinearKernel.ONEDNN else F.linear


def _onednn_usable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when oneDNN can compute this device's and dtype's products, else why not."""
    if device.type != "cpu":
        return f"oneDNN linears run on the CPU, not on {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN linears take float32 or bfloat16 weights, not {dtype}"
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no torch.ops.mkldnn._linear_pointwise"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=generator).to(dtype)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    try:
        with torch.inference_mode():
            got = _onednn_linear(x, weight, bias)
            want = F.linear(x, weight, bias)
    except RuntimeError as exc:
        return f"oneDNN's linear failed on a probe: {exc}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance):
        return "oneDNN's linear disagreed with F.linear on a probe"
    return None


def select_linear_kernel(
    device: torch.device | str, dtype: torch.dtype, kind: LinearKernel | str | None = None
) -> LinearKernel:
    """The kernel for weights of ``dtype`` on ``device``.

    Args:
        device: Where the weights live.
        dtype: The weights' dtype.
        kind: A kernel to use, or None for the default: oneDNN for float32 on a CPU
            whose torch has it (and computes a probe as ``F.linear`` does), else torch.

    Raises:
        ConfigError: ``kind`` is unknown, or oneDNN was asked for where it cannot run.
    """
    device = torch.device(device)
    if kind is None:
        if dtype == torch.float32 and _onednn_usable(device, dtype) is None:
            return LinearKernel.ONEDNN
        return LinearKernel.TORCH
    resolved = LinearKernel.parse(kind)
    if resolved is LinearKernel.ONEDNN:
        reason = _onednn_usable(device, dtype)
        if reason is not None:
            raise ConfigError(f"linear kernel 'onednn' cannot be used: {reason}")
    return resolved
