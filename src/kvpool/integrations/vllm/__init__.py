"""kvpool's tiers as a vLLM V1 KV connector: vLLM's blocks stored and loaded as signed kvpool entries.

Started by vLLM from its ``--kv-transfer-config``::

    {"kv_connector": "KVPoolConnector",
     "kv_connector_module_path": "kvpool.integrations.vllm",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"tiers": ["cpu:2GiB", "redis://127.0.0.1:6379/0"],
                                   "secret_file": "/etc/kvpool/tier.secret"}}

The package has three parts, so that only the last needs vLLM:

* :mod:`~kvpool.integrations.vllm.plan` (torch-free): the options, and the scheduler side's
  decisions: which blocks load from which tier, which are saved where, keyed by vLLM's own
  block hashes;
* :mod:`~kvpool.integrations.vllm.blocks` (torch): a vLLM block's tensors as one entry payload,
  and the worker side that carries out a step's plan against the stores;
* :mod:`~kvpool.integrations.vllm.connector` (vLLM): :class:`KVPoolConnector`, the thin class
  vLLM drives. It is imported on first use of the name, so the first two parts import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector with getattr(module, "KVPoolConnector"); only then is vLLM imported.
    if name == "KVPoolConnector":
        from kvpool.integrations.vllm.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
