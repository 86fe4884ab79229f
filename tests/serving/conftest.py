"""Tests of serving (kvhub.serving): the handoff and recompute, the vLLM connector's sides and configuration,
the engine pass, the serving KV store, tenants, `kvhub serve`, and the real-vLLM tests (-m vllm).  Shared
helpers stay at tests/ (from tests.x import ...); fixtures only these files use live here."""
