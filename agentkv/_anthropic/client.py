"""``agentkv.Anthropic`` / ``agentkv.AsyncAnthropic``: the anthropic SDK's clients, served
in-process.

As ``agentkv.OpenAI`` is for the openai SDK: real subclasses of ``anthropic.Anthropic`` /
``anthropic.AsyncAnthropic`` whose HTTP client's transport hands each request to the proxy's own
ASGI app in this process, so ``client.messages.create`` runs on the proxy's Messages API
(``POST /v1/messages``): one session mapping, no network hop. The session key is what the proxy
reads: ``session_id=`` given to the client (sent as ``X-Session-ID``), or per request
``extra_headers={"X-Session-ID": ...}`` (or Claude Code's ``X-Claude-Code-Session-Id``,
``metadata.user_id``). The anthropic SDK is an extra of its own: ``pip install
'agentkv[anthropic]'``.

>>> import agentkv
>>> client = agentkv.Anthropic(".agentkv/cluster.json", session_id="ticket-4711")  # doctest: +SKIP
>>> reply = client.messages.create(  # doctest: +SKIP
...     model=client.model, max_tokens=256, messages=[{"role": "user", "content": "Hello!"}]
... )
"""

from __future__ import annotations

import anthropic

from agentkv._core import AsyncCluster, Cluster
from agentkv._openai.client import InProcess

__all__ = ["Anthropic", "AsyncAnthropic"]

# The anthropic SDK adds ``/v1/messages`` itself.
BASE_URL = "http://agentkv.in-process"


class AsyncAnthropic(InProcess[AsyncCluster], anthropic.AsyncAnthropic):
    """``anthropic.AsyncAnthropic`` on an agentkv cluster, in-process.

    Args:
        cluster: an ``AsyncCluster`` (not closed by the client) or a cluster file's path
            (opened here and closed with the client).
        session_id: the session every request of this client runs on (``X-Session-ID``).
        config: the proxy's configuration.
        **options: the anthropic client's own (``max_retries``, ``timeout``,
            ``default_headers``).

    >>> async def main():  # doctest: +SKIP
    ...     async with agentkv.AsyncAnthropic(cluster, session_id="s1") as client:
    ...         reply = await client.messages.create(model=client.model, max_tokens=64, ...)
    """

    _cluster_type = AsyncCluster
    _app_base_url = BASE_URL



class Anthropic(InProcess[Cluster], anthropic.Anthropic):
    """``anthropic.Anthropic`` on an agentkv cluster, in-process (the sync twin of
    ``AsyncAnthropic``; the app runs on the cluster's own event-loop thread).

    >>> with agentkv.Anthropic(".agentkv/cluster.json") as client:  # doctest: +SKIP
    ...     reply = client.messages.create(model=client.model, max_tokens=64, messages=[...])
    """

    _cluster_type = Cluster
    _app_base_url = BASE_URL

