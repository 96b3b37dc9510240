"""``agentkv proxy``: an OpenAI-compatible, session-aware HTTP proxy in front of the P/D pairs.

Any OpenAI client (LangChain, curl, a TypeScript agent) gets the SDK's KV reuse: send
``X-Session-ID`` (or ``prompt_cache_key``) and re-send the conversation as usual; the proxy maps
it onto an agentkv session. See ``docs/proxy.md``.

>>> from agentkv import AsyncCluster
>>> from agentkv.proxy import ProxyConfig, create_app
>>> cluster = AsyncCluster.from_file(".agentkv/cluster.json")  # doctest: +SKIP
>>> app = create_app(cluster, ProxyConfig(session_idle_timeout_s=300))  # doctest: +SKIP
"""

from agentkv.proxy._app import create_app
from agentkv.proxy._config import ApiKeys, ProxyConfig
from agentkv.proxy._server import ProxyServer, serve

__all__ = ["ApiKeys", "ProxyConfig", "ProxyServer", "create_app", "serve"]
