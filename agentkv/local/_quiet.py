"""Environment that lets an idle local pair sleep instead of spinning its cores (docs/idle.md)."""

from __future__ import annotations

from agentkv.connector._plugin import plugin_env


def quiet_env() -> dict[str, str]:
    """Environment for each local vLLM CPU server: turns on agentkv's vLLM plugins.

    That is the general plugin (idle settings, lease calls) and the endpoint plugin (lease routes,
    handles on streamed responses), which vLLM loads only when ``VLLM_PLUGINS`` names it.
    """
    return plugin_env()
