"""vLLM-side extension of agentkv: a KV connector and plugin that honour the SDK's cache hints.

Loaded by vLLM, never by the SDK: ``--kv-transfer-config '{"kv_connector": "AgentKVConnector",
"kv_connector_module_path": "agentkv.connector", ...}'`` plus ``AGENTKV_VLLM_PLUGIN=1``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AgentKVConnector"]


def __getattr__(name: str) -> Any:
    # vLLM imports this module by path and looks the class up by name; importing vLLM lazily
    # keeps `import agentkv.connector` cheap and possible without vLLM installed.
    if name == "AgentKVConnector":
        from agentkv.connector._connector import AgentKVConnector

        return AgentKVConnector
    raise AttributeError(name)
