"""agentkv's vLLM general plugin: loaded by vLLM in every process it starts.

It only acts when ``AGENTKV_VLLM_PLUGIN=1`` is set (``agentkv up`` sets it; a GPU deployment sets
it on its vLLM servers), so installing agentkv next to vLLM never changes vLLM's behaviour by
itself. When on, it

* applies the idle-CPU settings (``_quiet``; ``AGENTKV_QUIET=0`` leaves vLLM's busy-waits as
  they are, for servers with cores to spare),
* lets the server load its own compile cache instead of compiling again (``_compile_cache``),
* installs the EngineCore utility that serves lease calls (``_engine_rpc``), and
* refuses to start unless ``VLLM_PLUGINS`` names ``agentkv``: vLLM loads endpoint plugins (our
  lease routes and the stream patch, ``_endpoint``) only when allowlisted there, and a server
  that silently streamed without handles would make every streamed turn recompute.
"""

from __future__ import annotations

import logging
import os

ENV_FLAG = "AGENTKV_VLLM_PLUGIN"
QUIET_ENV = "AGENTKV_QUIET"
PLUGIN_NAME = "agentkv"
ALLOWLIST_ENV = "VLLM_PLUGINS"


def enabled() -> bool:
    return os.environ.get(ENV_FLAG, "") == "1"


def plugin_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment that turns the plugin on for a vLLM server, keeping other allowlisted plugins.

    >>> plugin_env({"VLLM_PLUGINS": "other"})
    {'AGENTKV_VLLM_PLUGIN': '1', 'VLLM_PLUGINS': 'other,agentkv'}
    """
    current = (os.environ if environ is None else environ).get(ALLOWLIST_ENV)
    names = [n for n in (current or "").split(",") if n]
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return {ENV_FLAG: "1", ALLOWLIST_ENV: ",".join(names)}


def _check_allowlist() -> None:
    names = os.environ.get(ALLOWLIST_ENV)
    if names is None or PLUGIN_NAME not in names.split(","):
        raise RuntimeError(
            f"{ENV_FLAG}=1 but {ALLOWLIST_ENV} does not name {PLUGIN_NAME!r}: vLLM would not load "
            "agentkv's endpoint plugin (lease routes, handles on streamed responses). Set "
            f"{ALLOWLIST_ENV}={PLUGIN_NAME} (comma-separated with any others)."
        )


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group."""
    if not enabled():
        return
    _check_allowlist()
    # Imported here: vLLM imports this module in every process, also where the plugin is off.
    from agentkv._core import configure_logging
    from agentkv.connector import _compile_cache, _engine_rpc, _quiet

    # The connector's events (leases, tier writes) go to the server's log, at every level, as
    # they did before agentkv's events became quiet by default.
    configure_logging(logging.DEBUG)
    _compile_cache.apply()
    if os.environ.get(QUIET_ENV, "1") != "0":
        _quiet.apply()
    _engine_rpc.install()
