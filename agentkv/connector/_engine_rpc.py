"""The EngineCore side of agentkv's lease calls: one utility method, ``agentkv_leases``.

Why a utility call: the pins live in the scheduler-side connector inside the EngineCore process,
and vLLM's API server already reaches that process with utility calls (``call_utility_async``,
the way ``reset_prefix_cache`` travels). The call is queued with the engine's requests and runs
on the engine thread between steps, so it needs no lock, and it wakes an engine that was idling
on its input queue (``_quiet``), so a release frees its blocks at once. vLLM's endpoint-plugin
contract asks for exactly this split: a general plugin installs the engine-side method, the
endpoint plugin exposes it over HTTP.
"""

from __future__ import annotations

from typing import Any

METHOD = "agentkv_leases"
# Operations that run on the workers too (the tier's writes), through the executor.
TIER_OPS = ("offload", "offload_poll", "tier_delete")


def agentkv_leases(engine: Any, op: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Forward a lease call to the engine's KV connector, if it is agentkv's."""
    connector = engine.scheduler.get_kv_connector()
    if op in TIER_OPS:
        tier_handler = getattr(connector, "agentkv_tier_op", None)
        if tier_handler is None:
            return {"status": "unavailable"}
        answer: dict[str, Any] = tier_handler(op, payload, engine.model_executor.collective_rpc)
        return answer
    handler = getattr(connector, "agentkv_lease_op", None)
    if handler is None:  # stock NixlConnector (or none): hints are ignored there
        return {"status": "unavailable"}
    result: dict[str, Any] = handler(op, payload)
    return result


def install() -> None:
    """Add the utility method to vLLM's EngineCore class (idempotent; adds, never replaces)."""
    # Imported here so that the API server side (_endpoint) can name METHOD cheaply.
    from vllm.v1.engine.core import EngineCore

    existing = getattr(EngineCore, METHOD, None)
    if existing is agentkv_leases:
        return
    if existing is not None:
        raise RuntimeError(f"agentkv: vLLM's EngineCore already has a {METHOD!r} attribute")
    setattr(EngineCore, METHOD, agentkv_leases)
