"""Per-leg request settings the SDK has no option for, applied by an httpx2 transport.

Two things make the baselines honest and the modes independent, and the SDK cannot set either on
the leg that needs it:

* **cache_salt on the P leg.** vLLM mixes a request's ``cache_salt`` into the hash of its first KV
  block, so prefix-cache hits happen only between requests with the same salt; vLLM 0.32 keeps the
  salt when the prompt comes as ``kv_transfer_params.prompt_token_ids`` (``OnlineRenderer``:
  ``tokens_input(reuse_ids, cache_salt=...)``). The SDK sends ``extra_body`` on the D leg only, so
  the P leg's salt is set here. ``disagg`` gets a fresh salt on every P leg: prefill's cache is
  cold for the session, as with ``--no-enable-prefix-caching`` on P in the published benchmark or
  under production cache pressure. ``affinity`` and ``agentkv`` get one salt per session: prefill
  keeps the session's own blocks and nothing else's (per conversation in a replay with subagents:
  its sessions are one user, ``open_runner``).
* **No pin on decode for the baselines.** Standard disaggregated serving does not keep turn-end KV
  on decode; ``disagg`` and ``affinity`` never use it, so their D legs carry agentkv's pin hint
  ``{"persist": false}`` (decode frees the blocks at once, as without ``bidirectional_kv_xfer``)
  instead of pinning memory the agentkv sessions need.

Every mode's legs pass through the same rewrite (parse, set, serialize), so its cost, well under a
millisecond, is the same for all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import httpx2

from agentkv._core import PinHint, dumps, loads, with_hint

__all__ = ["LegRewriter", "SaltSource"]

_CHAT_PATH = "/v1/chat/completions"

SaltSource = Callable[[], str]


def _netloc(url: str) -> str:
    parsed = httpx2.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.host}:{port}"


class LegRewriter(httpx2.AsyncBaseTransport):
    """Wraps a transport; sets ``cache_salt`` on P legs and the pin hint on D legs.

    ``prefill_salt`` is called once per P leg (a fresh salt per turn, or the same one each time).
    The wrapped transport is shared and owned by the caller: ``aclose`` leaves it open.
    """

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport,
        *,
        prefill: Iterable[str],
        decode: Iterable[str],
        prefill_salt: SaltSource,
        pin_on_decode: bool,
    ) -> None:
        self._inner = inner
        self._prefill = frozenset(_netloc(url) for url in prefill)
        self._decode = frozenset(_netloc(url) for url in decode)
        self._prefill_salt = prefill_salt
        self._pin = pin_on_decode
        self.prefill_legs = 0
        self.decode_legs = 0

    def _rewrite(self, body: dict[str, Any], netloc: str) -> dict[str, Any] | None:
        if netloc in self._prefill:
            self.prefill_legs += 1
            return {**body, "cache_salt": self._prefill_salt()}
        if netloc in self._decode:
            self.decode_legs += 1
            params = body.get("kv_transfer_params")
            if self._pin or not isinstance(params, dict):
                return body
            return {**body, "kv_transfer_params": with_hint(params, PinHint(pin=False))}
        return None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        url = request.url
        if request.method != "POST" or url.path != _CHAT_PATH:
            return await self._inner.handle_async_request(request)
        port = url.port or (443 if url.scheme == "https" else 80)
        body = loads(await request.aread())
        rewritten = self._rewrite(body, f"{url.host}:{port}") if isinstance(body, dict) else None
        if rewritten is None:
            return await self._inner.handle_async_request(request)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
        forwarded = httpx2.Request(
            request.method,
            url,
            headers=headers,
            content=dumps(rewritten),
            extensions=request.extensions,
        )
        return await self._inner.handle_async_request(forwarded)

    async def aclose(self) -> None:
        """The wrapped transport is shared: its owner closes it."""
