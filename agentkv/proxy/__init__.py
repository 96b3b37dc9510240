"""``agentkv proxy``: an OpenAI-compatible, session-aware HTTP proxy in front of the P/D pairs.

Any OpenAI client (LangChain, curl, a TypeScript agent) gets the SDK's KV reuse: send
``X-Session-ID`` (or ``prompt_cache_key``) and re-send the conversation as usual; the proxy maps
it onto an agentkv session. See ``docs/proxy.md``.

>>> from agentkv import AsyncCluster
>>> from agentkv.proxy import ProxyConfig, create_app
>>> cluster = AsyncCluster.from_file(".agentkv/cluster.json")  # doctest: +SKIP
>>> app = create_app(cluster, ProxyConfig(session_idle_timeout_s=300))  # doctest: +SKIP
"""

from typing import TYPE_CHECKING, Any

from agentkv.proxy._config import ApiKeys, ProxyConfig

if TYPE_CHECKING:
    from agentkv.proxy._app import create_app
    from agentkv.proxy._server import ProxyServer, serve

__all__ = ["ApiKeys", "ProxyConfig", "ProxyServer", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    # The app needs starlette (the ``proxy`` extra): import it on first use, so that the CLI can
    # register ``agentkv proxy`` and read its config where the extra is not installed.
    if name == "create_app":
        from agentkv.proxy._app import create_app

        return create_app
    if name in ("ProxyServer", "serve"):
        from agentkv.proxy import _server

        return getattr(_server, name)
    raise AttributeError(name)
