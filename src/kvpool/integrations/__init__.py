"""kvpool inside other inference servers.

* :mod:`kvpool.integrations.vllm`: kvpool's CPU, disk and Redis tiers as a vLLM V1 KV connector.

An integration imports its server only inside its own modules: ``import kvpool`` never needs it.
"""
