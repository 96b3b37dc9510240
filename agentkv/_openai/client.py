"""``agentkv.OpenAI`` / ``agentkv.AsyncOpenAI``: the openai SDK's clients, served in-process.

Code written against the openai SDK (and every framework that takes an openai client) gets
session reuse by changing the line that builds its client. These are real subclasses of
``openai.OpenAI`` / ``openai.AsyncOpenAI``; their HTTP client's transport hands each request to
the proxy's own ASGI app (``agentkv.proxy.create_app``) in this process, so a request is mapped
onto its session by the proxy's code, not by a copy of it, with no network hop. Answers are the
openai SDK's typed objects; the proxy's error answers become the SDK's own exceptions
(``openai.BadRequestError``, ``openai.NotFoundError``, ...).

The session key is what the proxy reads: ``extra_headers={"X-Session-ID": ...}``, the body's
``conversation_id``, or ``session_id=`` given to the client (sent as ``X-Session-ID`` on every
request); ``prompt_cache_key`` alone places conversations and finds each by its history.
``close()`` closes every session and releases their pinned handles; a cluster the client opened
from a file is closed with it.

>>> import agentkv
>>> client = agentkv.OpenAI(".agentkv/cluster.json", session_id="ticket-4711")  # doctest: +SKIP
>>> reply = client.chat.completions.create(  # doctest: +SKIP
...     model=client.model, messages=[{"role": "user", "content": "Hello!"}]
... )
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import httpx2
import openai

from agentkv._core import AsyncCluster, Cluster
from agentkv._openai.transport import AppTransport, AsyncAppTransport
from agentkv.proxy._app import create_app
from agentkv.proxy._config import ProxyConfig

__all__ = ["AsyncOpenAI", "InProcess", "OpenAI"]

# Requests never leave the process; the host only has to be a valid URL's.
BASE_URL = "http://agentkv.in-process/v1"
# Sessions are scoped by the key a client presents (docs/proxy.md): one key per process is
# enough, and the caller's real OPENAI_API_KEY is never read.
API_KEY = "agentkv-in-process"

ClusterSource = str | Path
ClusterT = TypeVar("ClusterT", AsyncCluster, Cluster)


def _headers(session_id: str | None, options: dict[str, Any]) -> dict[str, Any]:
    headers = dict(options.pop("default_headers", None) or {})
    if session_id is not None:
        headers["X-Session-ID"] = session_id
    return headers


def _is_copy(cluster: object, options: dict[str, Any]) -> bool:
    """``copy()`` / ``with_options()`` build a new client from openai's own arguments, sharing
    the HTTP client (and so the in-process app)."""
    return cluster is None and options.get("http_client") is not None


def _check_options(options: dict[str, Any]) -> None:
    for name in ("http_client", "base_url"):
        if options.get(name) is not None:
            raise TypeError(f"{name} is agentkv's: requests are served in-process by the cluster")


# The model each in-process HTTP client serves, by client: a copy (``with_options``) is handed
# only the client, and httpx2's clients do not say which transport they hold.
_SERVED: weakref.WeakKeyDictionary[httpx2.Client | httpx2.AsyncClient, str] = (
    weakref.WeakKeyDictionary()
)


def _served_model(http_client: httpx2.Client | httpx2.AsyncClient) -> str:
    return _SERVED.get(http_client, "")


class InProcess(Generic[ClusterT]):
    """The twins' constructor, written once (the anthropic twins' too): the SDK client's
    arguments for a cluster (no I/O but opening a cluster file), and the HTTP client that serves
    the proxy's app for it (``_http_client``). A twin says which cluster it takes and where the
    SDK's paths start (``_app_base_url``); the SDK client next in its MRO takes the rest.
    """

    model: str
    _cluster_type: type[ClusterT]
    # Where the SDK sends its requests (its own paths follow): the in-process app's root.
    _app_base_url: str = BASE_URL

    def __init__(
        self,
        cluster: ClusterT | ClusterSource | None = None,
        *,
        session_id: str | None = None,
        config: ProxyConfig | None = None,
        **options: Any,
    ) -> None:
        if _is_copy(cluster, options):
            self.model = _served_model(options["http_client"])
            super().__init__(**options)
            return
        if cluster is None:
            raise TypeError(f"{type(self).__name__} needs a cluster: {self._wanted}")
        _check_options(options)
        if isinstance(cluster, self._cluster_type):
            source, owned = cluster, False
        else:
            source, owned = self._cluster_type.from_file(cast(ClusterSource, cluster)), True
        self.model = source.model
        options.setdefault("api_key", API_KEY)
        options["base_url"] = self._app_base_url
        # The openai client next in the twin's MRO takes these (mypy sees only ``object``).
        super().__init__(  # type: ignore[call-arg]
            default_headers=_headers(session_id, options),
            http_client=self._http_client(source, config, owned=owned),
            **options,
        )

    @property
    def _wanted(self) -> str:
        name = self._cluster_type.__name__
        return f"{'an' if name[0] in 'AEIOU' else 'a'} {name} or a cluster file path"

    def _http_client(
        self, source: ClusterT, config: ProxyConfig | None, *, owned: bool
    ) -> httpx2.Client | httpx2.AsyncClient:
        """An HTTP client whose transport hands each request to the proxy's app on ``source``
        (closing ``source`` with it when ``owned``)."""
        if isinstance(source, AsyncCluster):
            app = create_app(source, config)
            transport = AsyncAppTransport(
                app,
                model=source.model,
                lifespan=lambda: app.router.lifespan_context(app),
                on_close=source.aclose if owned else None,
                direct=app.state.endpoints,
            )
            client: httpx2.Client | httpx2.AsyncClient = httpx2.AsyncClient(
                transport=transport, base_url=self._app_base_url
            )
        else:
            assert isinstance(source, Cluster)
            sync_app = create_app(source._async, config)
            sync_transport = AppTransport(
                sync_app,
                model=source.model,
                portal=source._portal,
                lifespan=lambda: sync_app.router.lifespan_context(sync_app),
                on_close=source.close if owned else None,
                direct=sync_app.state.endpoints,
            )
            client = httpx2.Client(transport=sync_transport, base_url=self._app_base_url)
        _SERVED[client] = source.model
        return client


class AsyncOpenAI(InProcess[AsyncCluster], openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` on an agentkv cluster, in-process.

    Args:
        cluster: an ``AsyncCluster`` (not closed by the client) or a cluster file's path
            (opened here and closed with the client).
        session_id: the session every request of this client runs on (``X-Session-ID``);
            without it, each request names its own (see the module docstring).
        config: the proxy's configuration (idle expiry, session bound, tool calling mode).
        **options: the openai client's own (``max_retries``, ``timeout``, ``default_headers``).

    >>> async def main():  # doctest: +SKIP
    ...     async with agentkv.AsyncOpenAI(cluster, session_id="s1") as client:
    ...         reply = await client.chat.completions.create(model=client.model, messages=[...])
    """

    _cluster_type = AsyncCluster



class OpenAI(InProcess[Cluster], openai.OpenAI):
    """``openai.OpenAI`` on an agentkv cluster, in-process (the sync twin of ``AsyncOpenAI``).

    Args:
        cluster: a ``Cluster`` (not closed by the client) or a cluster file's path (opened here
            and closed with the client). The app runs on the cluster's own event-loop thread.
        session_id: the session every request of this client runs on (``X-Session-ID``).
        config: the proxy's configuration.
        **options: the openai client's own.

    >>> with agentkv.OpenAI(".agentkv/cluster.json", session_id="s1") as client:  # doctest: +SKIP
    ...     reply = client.chat.completions.create(model=client.model, messages=[...])
    """

    _cluster_type = Cluster

