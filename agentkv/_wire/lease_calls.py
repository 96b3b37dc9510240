"""The lease routes of the decode servers, as calls: info, release, release-request, extend,
claim, offload (to the file tier) and tier delete.

The HTTP side of a session's pinned KV (``_leasing`` decides when to call; ``_hints`` is the wire
form). No session state here: a call takes a decode URL and a handle, and answers a
``CallResult`` whose ``outcome`` says what decode did. Never raises for the server's sake.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentkv import _constants as defaults
from agentkv._exceptions import TransportError
from agentkv._log import get_logger
from agentkv._types import KVHandle
from agentkv._wire.handoff import lease_ref
from agentkv._wire.hints import (
    CLAIM_PATH,
    EXTEND_PATH,
    INFO_PATH,
    RELEASE_PATH,
    RELEASE_REQUEST_PATH,
    ExtendRequest,
    ExtendResult,
    HintError,
    RequestRelease,
    ServerInfo,
)
from agentkv._wire.http import exchange
from agentkv._wire.json import dumps
from agentkv._wire.metrics import sample_values
from agentkv._wire.tier import (
    LEGACY_OFFLOAD_PATH,
    TIER_DELETE_PATH,
    OffloadRequest,
    OffloadResult,
    TierDelete,
    TierRef,
)
from agentkv._wire.transport import Poster

__all__ = [
    "FAILED",
    "GONE",
    "OK",
    "RECHECK_UNSUPPORTED_S",
    "UNAVAILABLE",
    "CallResult",
    "LeaseCalls",
]

logger = get_logger("agentkv")

RECHECK_UNSUPPORTED_S = defaults.RECHECK_UNSUPPORTED_S
METRICS_PATH = "/metrics"
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
WAITING_METRIC = "vllm:num_requests_waiting_by_reason"
CAPACITY_LABEL = 'reason="capacity"'
_CALL_TIMEOUT_S = defaults.LEASE_CALL_TIMEOUT_S

# Outcomes of a lease call, as logged (``outcome``).
OK = "ok"
GONE = "gone"  # 404/410: decode holds nothing for this handle (consumed, expired, released)
UNAVAILABLE = "unavailable"  # 501: decode runs the plugin with a stock connector
FAILED = "failed"  # transport error, 5xx, or an answer we cannot read


@dataclass(frozen=True, kw_only=True, slots=True)
class CallResult:
    outcome: str
    status: int | None
    detail: str = ""
    extended: ExtendResult | None = None
    offloaded: OffloadResult | None = None

    @property
    def persisted(self) -> OffloadResult | None:
        """The old name of :attr:`offloaded` (the session's executor reads it until issue 41's
        rename reaches it)."""
        return self.offloaded


def _error_code(data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else ""


def _outcome(status: int) -> str:
    if status in (404, 410):
        return GONE
    if status == 501:
        return UNAVAILABLE
    return FAILED


class LeaseCalls:
    """The lease routes of a cluster's decode servers, and which servers have them.

    One per cluster: whether a decode runs agentkv's extension is asked once per server
    (``GET /v1/agentkv/info``). A "yes" is kept until the server is marked down (it may come
    back restarted, with another build: :meth:`forget`); a "no" also for at most
    :data:`RECHECK_UNSUPPORTED_S`, so a decode restarted with the extension is found.
    """

    def __init__(
        self, client: Poster, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._client = client
        self._clock = clock
        self._support: dict[str, bool] = {}
        # Whether a decode with leases has a file tier (``ServerInfo.tier``), from the same ask.
        self._tier: dict[str, bool] = {}
        # Whether that tier writes copies that keep the pin (``tier.copy``: forks).
        self._copies: dict[str, bool] = {}
        self._unsupported_at: dict[str, float] = {}
        self._warned: set[str] = set()
        self._asking: dict[str, asyncio.Task[bool | None]] = {}
        self._lost: set[asyncio.Task[None]] = set()

    async def supported(self, decode: str) -> bool | None:
        """Whether ``decode`` has agentkv's extension: ``None`` when it could not be asked (it is
        asked again next time)."""
        known = self._support.get(decode)
        if known is False and self._clock() - self._unsupported_at[decode] >= RECHECK_UNSUPPORTED_S:
            known = None  # ask again: it may have been restarted with the extension
        if known is not None:
            return known
        task = self._asking.get(decode)
        if task is None:
            task = asyncio.ensure_future(self._ask(decode))
            self._asking[decode] = task
            task.add_done_callback(lambda _: self._asking.pop(decode, None))
        # Shielded: one caller giving up (a cancelled turn) must not cancel the others' answer.
        return await asyncio.shield(task)

    async def _ask(self, decode: str) -> bool | None:
        try:
            status, data = await exchange(
                self._client, "GET", decode + INFO_PATH, timeout_s=_CALL_TIMEOUT_S
            )
        except TransportError as exc:
            logger.debug("agentkv.leases_unknown", decode=decode, detail=str(exc))
            return None
        if status == 200:
            try:
                info = ServerInfo.from_wire(data)
            except HintError as exc:
                reason = f"unreadable {INFO_PATH} answer: {exc}"
            else:
                if info.leases:
                    self._support[decode] = True
                    self._tier[decode] = info.tier is not None
                    self._copies[decode] = info.tier is not None and info.tier.get("copy") is True
                    self._warned.discard(decode)
                    logger.debug(
                        "agentkv.leases_available",
                        decode=decode,
                        default_ttl_s=info.default_ttl_s,
                        max_ttl_s=info.max_ttl_s,
                    )
                    return True
                reason = "the agentkv plugin runs, but decode's KV connector is vLLM's own"
        elif status == 404:
            reason = f"no agentkv plugin on decode ({INFO_PATH} answered 404)"
        else:
            logger.debug("agentkv.leases_unknown", decode=decode, status=status)
            return None
        self._support[decode] = False
        self._unsupported_at[decode] = self._clock()
        if decode in self._warned:
            return False
        self._warned.add(decode)
        logger.warning(
            "agentkv.leases_unavailable",
            decode=decode,
            reason=reason,
            fallback="stock vLLM: turn-end KV is pinned for the server's TTL; no release or extend",
            hint="run decode with AgentKVConnector and VLLM_PLUGINS=agentkv (docs/connector.md)",
        )
        return False

    def forget(self, decode: str) -> None:
        """``decode`` went down: ask again once it is back (a restart may change the answer)."""
        self._support.pop(decode, None)
        self._tier.pop(decode, None)
        self._copies.pop(decode, None)

    def tier(self, decode: str) -> bool:
        """Whether ``decode`` has a file tier, as its info answer said (False until asked)."""
        return self._support.get(decode) is True and self._tier.get(decode, False)

    def copies(self, decode: str) -> bool:
        """Whether ``decode``'s tier writes a copy of a pin and keeps it (``offload(keep=True)``),
        as its info answer said (False until asked, and for an older connector)."""
        return self.tier(decode) and self._copies.get(decode, False)

    async def kv_usage(self, decode: str) -> float | None:
        """Decode's KV memory in use (0-1, vLLM's ``kv_cache_usage_perc``, the fullest engine),
        read from its ``/metrics``, and 1.0 while requests wait there for KV capacity
        (``vllm:num_requests_waiting_by_reason{reason="capacity"}``); ``None`` when it cannot
        be read. For the tier policy's memory-pressure rule and the proxy's pressure relief:
        one small request, asked only when a decision depends on it."""
        url = decode + METRICS_PATH
        try:
            answer = await self._client.get(url, timeout_s=_CALL_TIMEOUT_S)
        except TransportError as exc:
            logger.debug("agentkv.kv_usage_unknown", decode=decode, detail=str(exc))
            return None
        if answer.status != 200:
            return None
        text = answer.body.decode("utf-8", "replace")
        # Requests waiting for KV capacity: decode is full for the work it has, whatever
        # fraction its blocks in use come to (a new turn needs more than what is free).
        if any(sample_values(text, WAITING_METRIC, label=CAPACITY_LABEL)):
            return 1.0
        usage = sample_values(text, KV_USAGE_METRIC)
        return max(usage) if usage else None

    async def _call(
        self, url: str, body: dict[str, Any], *, timeout_s: float = _CALL_TIMEOUT_S
    ) -> tuple[int, Any] | CallResult:
        try:
            return await exchange(
                self._client, "POST", url, body=dumps(body), timeout_s=timeout_s
            )
        except TransportError as exc:
            return CallResult(outcome=FAILED, status=None, detail=str(exc))

    async def release(self, decode: str, handle: KVHandle) -> CallResult:
        answer = await self._call(decode + RELEASE_PATH, lease_ref(handle).to_wire())
        if isinstance(answer, CallResult):
            return answer
        status, data = answer
        if status == 200:
            return CallResult(outcome=OK, status=status)
        return CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))

    async def release_request(self, decode: str, secret: str) -> CallResult:
        answer = await self._call(
            decode + RELEASE_REQUEST_PATH, RequestRelease(secret=secret).to_wire()
        )
        if isinstance(answer, CallResult):
            return answer
        status, data = answer
        if status == 200:
            released = data.get("released") if isinstance(data, dict) else None
            return CallResult(outcome=OK, status=status, detail=f"released {released}")
        return CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))

    def track(self, task: asyncio.Task[None]) -> None:
        """Keep a background release alive until it is done (:meth:`settle` waits for it)."""
        self._lost.add(task)
        task.add_done_callback(self._lost.discard)

    async def settle(self, *, timeout_s: float | None = None) -> None:
        """Wait for the background calls still in flight (a close waits for them); those still
        running after ``timeout_s`` are cancelled. Either way each outcome is retrieved: none is
        logged by asyncio as never retrieved."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self._lost:
            tasks = list(self._lost)
            left = None if deadline is None else max(0.0, deadline - loop.time())
            _, pending = await asyncio.wait(tasks, timeout=left)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self, *, settle_s: float) -> None:
        """Before the client closes: settle the background calls (``settle``) and cancel any
        question about support still in flight."""
        await self.settle(timeout_s=settle_s)
        asking = list(self._asking.values())
        for task in asking:
            task.cancel()
        await asyncio.gather(*asking, return_exceptions=True)

    async def extend(
        self, decode: str, handle: KVHandle, *, ttl_s: float, claim: bool = False
    ) -> CallResult:
        """Keep ``handle`` pinned ``ttl_s`` more seconds; with ``claim``, also take its lease
        (decode answers with a new secret: every other holder of the old one is refused)."""
        request = ExtendRequest(ref=lease_ref(handle), ttl_s=ttl_s)
        answer = await self._call(decode + (CLAIM_PATH if claim else EXTEND_PATH),
                                  request.to_wire())
        if isinstance(answer, CallResult):
            return answer
        status, data = answer
        if status != 200:
            return CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))
        try:
            result = ExtendResult.from_wire(data)
            if claim and result.lease is None:
                raise HintError("a claim answer carries no new lease secret")
        except HintError as exc:
            return CallResult(outcome=FAILED, status=status, detail=str(exc))
        return CallResult(outcome=OK, status=status, extended=result)

    async def offload(
        self, decode: str, handle: KVHandle, *, ttl_s: float | None = None, keep: bool = False
    ) -> CallResult:
        """Offload a leased handle to decode's file tier (decode frees the pin on success), for
        ``ttl_s`` seconds (decode caps it; ``None``: decode's default). The answer's reference
        carries the entry's secret, which the delete needs. Sent to the route's first name,
        which every connector serves (``tier.LEGACY_OFFLOAD_PATH``). ``keep``: write a copy and
        keep the pin; refused here (``unavailable``) unless ``copies(decode)``, since an older
        connector would free the pin."""
        if keep and not self.copies(decode):
            return CallResult(outcome=UNAVAILABLE, status=None, detail="decode writes no copies")
        request = OffloadRequest(ref=lease_ref(handle), ttl_s=ttl_s, keep=keep)
        answer = await self._call(decode + LEGACY_OFFLOAD_PATH, request.to_wire(),
                                  timeout_s=defaults.OFFLOAD_CALL_TIMEOUT_S)
        if isinstance(answer, CallResult):
            return answer
        status, data = answer
        if status != 200:
            code = _error_code(data)
            if status == 501 and code == "tier_unavailable":
                self._tier[decode] = False
            return CallResult(outcome=_outcome(status), status=status, detail=code)
        try:
            result = OffloadResult.from_wire(data)
        except HintError as exc:
            return CallResult(outcome=FAILED, status=status, detail=str(exc))
        return CallResult(outcome=OK, status=status, offloaded=result)

    # The old name (the session's executor calls it until issue 41's rename reaches it).
    persist = offload

    async def delete_tier(self, decode: str, ref: TierRef) -> CallResult:
        """Delete a tier entry (its session moved on) with its secret; 404 (``gone``) for a
        missing entry and a wrong secret alike. A reference without a secret (a session saved
        before tier secrets) cannot delete: nothing is sent, the entry expires with its TTL."""
        if ref.secret is None:
            return CallResult(outcome=FAILED, status=None, detail="no secret for this tier entry")
        delete = TierDelete(id=ref.id, secret=ref.secret)
        answer = await self._call(decode + TIER_DELETE_PATH, delete.to_wire())
        if isinstance(answer, CallResult):
            return answer
        status, data = answer
        if status == 200:
            deleted = data.get("deleted") if isinstance(data, dict) else None
            return CallResult(outcome=OK, status=status, detail=f"deleted {deleted}")
        return CallResult(outcome=_outcome(status), status=status, detail=_error_code(data))
