"""One fake vLLM engine with the NixlConnector (pull mode, bidirectional transfer).

The connector decisions follow ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``
``pull_scheduler.py`` and ``pull_worker.py`` (vLLM 0.32):

* ``do_remote_prefill`` (a D leg): load ``prompt_len - local_hit`` tokens from the producer.
* ``do_remote_decode`` with a full handle (a P leg after a turn): load
  ``min(remote_num_tokens, prompt_len) - local_hit`` tokens, unless that is below
  ``kv_recompute_threshold``; either way the producer is notified and frees its blocks.
* The read is positional: the last ``n`` remote blocks fill the ``n`` blocks after the local
  hit. Nothing compares tokens; wrong KV is only visible in what the model then generates.
* A turn-2 read whose ``remote_blocks_expiry_time`` is within 5 s is declined; a failed load
  fails the request (``kv_load_failure_policy="fail"``, vLLM's default) with a 500.
* On finish, a request that carried ``kv_transfer_params`` keeps its blocks: for
  ``kv_lease_duration`` (30 s) on a producer, for ``decoder_kv_blocks_ttl`` on a decoder.

With ``leases`` the engine runs agentkv's ``AgentKVConnector`` instead (``agentkv/connector``): a
decoder's turn-end pin is decided by the connector's own ``apply_pin_policy`` (pin hint,
requests released early by their client) and leased with its ``LeaseBook``/``LeaseService``, and
:meth:`FakeEngine.lease_op` serves the lease calls.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from agentkv._core import (
    HintError,
    OffloadRequest,
    TierDelete,
    TierLoadReport,
    TierRef,
    with_tier_load,
)
from agentkv.connector._leases import LeaseBook, LeaseService, Outcome, apply_pin_policy
from agentkv.testing._fake_kv import (
    ROOT_HASH,
    BlockContent,
    BlockPool,
    block_hashes,
    chain,
    is_true_content,
    kv_state,
    write_tokens,
)
from agentkv.testing._fake_metrics import EngineStats
from agentkv.testing._fake_model import FakeModel, Generation, ToolSpec
from agentkv.testing._fake_stop import find_stop
from agentkv.testing._fake_tier import FakeTier, TierFullError
from agentkv.testing._fake_tokenizer import FakeTokenizer

# pull_worker.py: slack subtracted from D's exported deadline on the turn-2 readback.
EXPIRY_SAFETY_MARGIN_S: Final = 5.0
# SmolLM2-135M in bf16: 30 layers x (K, V) x 3 KV heads x 64 dims x 2 bytes.
BYTES_PER_TOKEN: Final = 30 * 2 * 3 * 64 * 2
_GARBAGE: Final = -1
_HANDLE_KEYS: Final = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

KVLoadFailurePolicy = Literal["fail", "recompute"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    block_size: int
    num_blocks: int
    decoder_kv_blocks_ttl: float
    kv_recompute_threshold: int
    kv_lease_duration: float = 30.0
    bidirectional_kv_xfer: bool = True
    kv_load_failure_policy: KVLoadFailurePolicy = "fail"
    # agentkv's connector: pin hints and leases (kv_connector_extra_config agentkv_max_ttl_s).
    leases: bool = False
    agentkv_max_ttl_s: float = 3600.0


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    tool: ToolSpec | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM mixes the salt into the prefix-cache keys: requests share cached blocks only when their
    # salts are equal. It changes which blocks are found, never what a block's KV is.
    cache_salt: str | None = None
    # Checked by the front end as the tokens come (``_fake_stop``); a hit aborts the request.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False


@dataclass(frozen=True, kw_only=True)
class EngineResult:
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    num_cache_creation_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # Set when a stop string ended the request: the string, and the output text vLLM returns.
    stop_reason: str | None = None
    text: str | None = None


class EngineError(RuntimeError):
    """The request finished with an error (vLLM answers 500 "Internal server error")."""


class Fabric(Protocol):
    """How engines reach each other's KV: the NIXL side channel, keyed by host and port."""

    def lookup(self, host: Any, port: Any) -> FakeEngine | None: ...

    def record_wrong_reuse(self, reader: FakeEngine) -> None: ...


@dataclass(slots=True)
class _Pin:
    block_ids: list[int]
    deadline: float
    turn_end: bool
    # The tokens whose KV the blocks hold and the request's salt (what a tier offload records).
    tokens: tuple[int, ...] = ()
    cache_salt: str | None = None
    # Whether vLLM's worker tracks the pin (``_reqs_in_batch``): it frees the blocks of a pin
    # it does not track never (not on a read, a release or the deadline).
    tracked: bool = True


@dataclass(slots=True)
class _Load:
    blocks: list[BlockContent] = field(default_factory=list)
    num_tokens: int = 0
    # How a tier reference served (``TierScheduler``'s report, in prefill's answer).
    tier: TierLoadReport | None = None


class _KVLoadError(Exception):
    pass


class FakeEngine:
    """The engine core behind one fake server: scheduler, KV pool, connector and model."""

    def __init__(
        self,
        *,
        config: EngineConfig,
        tokenizer: FakeTokenizer,
        model: FakeModel,
        clock: Callable[[], float],
        fabric: Fabric,
        side_channel: tuple[str, int],
        model_name: str,
        tier: FakeTier | None = None,
    ) -> None:
        self.config = config
        self._tier = tier
        self.engine_id = str(uuid.uuid4())
        self.side_channel_host, self.side_channel_port = side_channel
        self.stats = EngineStats(model_name=model_name, kv_cache_usage=lambda: self.kv_cache_usage)
        self._tok = tokenizer
        self._model = model
        self._clock = clock
        self._fabric = fabric
        self._pool = BlockPool(config.num_blocks)
        self._pins: dict[str, _Pin] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._book: LeaseBook | None = None
        self._leases: LeaseService | None = None
        if config.leases:
            self._book = LeaseBook(clock=clock, max_ttl_s=config.agentkv_max_ttl_s)
            self._leases = LeaseService(
                self._book,
                set_deadline=self._set_deadline,
                clock=clock,
                default_ttl_s=config.decoder_kv_blocks_ttl,
            )

    # ----------------------------------------------------------------- observation

    @property
    def kv_cache_usage(self) -> float:
        self.expire()
        return self._pool.usage

    @property
    def leases(self) -> int:
        """Leases agentkv's connector holds (0 without ``leases``)."""
        self.expire()
        return 0 if self._book is None else len(self._book)

    def pinned(self, *, turn_end: bool) -> int:
        self.expire()
        return sum(1 for pin in self._pins.values() if pin.turn_end == turn_end)

    def expire(self) -> None:
        """Release pins whose deadline passed (vLLM's worker does this every step)."""
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self._deadlines)
            pin = self._pins.get(request_id)
            if pin is not None and pin.deadline == deadline and pin.tracked:
                del self._pins[request_id]
                self._pool.free(pin.block_ids)
                self._forget(request_id)

    def on_remote_read(self, request_id: Any) -> None:
        """A consumer's "done reading" notification: free the blocks, or log a stale read."""
        pin = self._pins.get(request_id) if isinstance(request_id, str) else None
        if pin is None or not pin.tracked:  # vLLM: "unrecognized request ... retrieved"
            self.stats.nixl_notifications_after_expiry.inc()
            return
        del self._pins[request_id]
        self._pool.free(pin.block_ids)
        self._forget(request_id)

    def lease_op(self, op: str, payload: object) -> dict[str, object]:
        """``AgentKVConnector.agentkv_lease_op``: ``info``, ``release``, ``extend`` or ``claim``.

        Like a lease call on vLLM, it wakes the engine: what it decided applies at once.
        """
        if self._leases is None:
            return {"status": "unavailable"}
        if op in ("offload", "tier_delete"):
            return self._tier_op(op, payload)
        answer = self._leases.handle(op, payload)
        if op == "info" and answer.get("status") == "ok":
            answer["tier"] = None if self._tier is None else {
                **self._tier.usage().to_wire(),
                "copy": True,
            }
        self.expire()
        return answer

    def _tier_op(self, op: str, payload: object) -> dict[str, object]:  # noqa: PLR0911 - per status
        """``AgentKVConnector.agentkv_tier_op``: offload a leased pin, or delete an entry."""
        if self._tier is None or self._book is None or self._leases is None:
            return {"status": "tier_unavailable"}
        try:
            if op == "tier_delete":
                delete = TierDelete.from_wire(payload)
                if not self._tier.delete(delete.id, delete.secret):
                    return {"status": "unknown", "message": "no such tier entry, or not yours"}
                return {"status": "ok", "deleted": True}
            request = OffloadRequest.from_wire(payload)
        except HintError as exc:
            return {"status": "invalid", "message": str(exc)}
        ref = request.ref
        self.expire()
        outcome, lease = self._book.check(ref)
        if outcome is not Outcome.OK or lease is None:
            return {"status": outcome.value}
        pin = self._pins.get(ref.request_id)
        if pin is None or not pin.tokens:
            return {"status": "tier_failed", "message": "no token record for this handle"}
        n_blocks = -(-len(pin.tokens) // self.config.block_size)
        try:
            result = self._tier.write(
                token_ids=pin.tokens,
                cache_salt=pin.cache_salt,
                blocks=[self._pool.read(b) for b in pin.block_ids[:n_blocks]],
                ttl_s=request.ttl_s,
            )
        except TierFullError as exc:
            return {"status": "tier_failed", "message": f"tier write failed: {exc}"}
        if not request.keep:  # a copy keeps the pin
            # Written and committed: now, and only now, free decode's blocks.
            self._leases.handle("release", ref.to_wire())
        self.expire()
        return {"status": "ok", **result.to_wire()}

    def _set_deadline(self, request_id: str, deadline: float) -> None:
        # The worker keeps the latest deadline of a pin; a past one frees it at the next step.
        pin = self._pins.get(request_id)
        if pin is not None:
            pin.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, request_id))

    def _forget(self, request_id: str) -> None:
        if self._book is not None:
            self._book.forget((request_id,))

    def reject(self, params: dict[str, Any] | None) -> None:
        """A D leg refused before scheduling still releases the prefill server's blocks."""
        if params and params.get("do_remote_prefill"):
            self._notify_only(params)

    def holds(self, request_id: Any, block_ids: list[Any]) -> bool:
        """Whether ``block_ids`` are still pinned for ``request_id`` (not freed, not reused)."""
        pin = self._pins.get(request_id) if isinstance(request_id, str) else None
        return pin is not None and all(b in pin.block_ids and self._pool.held(b) for b in block_ids)

    def read_block(self, block_id: Any) -> BlockContent:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise IndexError(f"bad block id {block_id!r}")
        return self._pool.read(block_id)

    # ------------------------------------------------------------------- requests

    def run(self, request: EngineRequest) -> EngineResult:
        self.expire()
        bs = self.config.block_size
        prompt = list(request.prompt)
        n_prompt = len(prompt)
        hashes = block_hashes(prompt, bs)
        keys = _salted(hashes, request.cache_salt)
        # vLLM never serves the whole prompt from cache: the last token must be computed.
        local_ids = self._pool.lookup(keys[: (n_prompt - 1) // bs])
        local = len(local_ids) * bs
        params = dict(request.kv_transfer_params) if request.kv_transfer_params else None
        # A request that neither pulls nor is prefilled for another server (agentkv's decode
        # route): vLLM 0.32 pins it at the end but leaves it out of ``_reqs_in_batch``;
        # AgentKVConnector puts it in (``_track_local``).
        untracked = (
            params is not None
            and not params.get("do_remote_prefill")
            and not params.get("do_remote_decode")
            and self._book is None
        )

        load = self._connector_load(params, prompt, hashes, local, salt=request.cache_salt)
        blocks = [self._pool.read(b) for b in local_ids] + load.blocks
        start = local + load.num_tokens
        write_tokens(blocks, prompt, min(start, n_prompt - 1), n_prompt, bs)

        generation = self._model.generate(
            kv_state(blocks),
            max_tokens=request.max_tokens,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            tool=request.tool,
        )
        hit = find_stop(
            self._tok,
            generation.token_ids,
            stop=request.stop,
            include=request.include_stop_str_in_output,
            min_tokens=request.min_tokens,
        )
        # A stop string found before the engine finished the request: the front end aborts it
        # (vLLM's ``reqs_to_abort``), so it ends there and its KV is not kept for a reader.
        aborted = hit is not None and hit.num_tokens < len(generation.token_ids)
        if hit is not None:
            generation = Generation(
                token_ids=generation.token_ids[: hit.num_tokens], finish_reason="stop"
            )
        # The last sampled token is never fed back, so it has no KV.
        seq = prompt + generation.token_ids[:-1]
        write_tokens(blocks, seq, n_prompt, len(seq), bs)
        block_ids = self._store(blocks, seq, keys, local_ids)

        num_cached = local + load.num_tokens
        full_blocks_after_prefill = (n_prompt // bs) * bs
        self._account(generation, n_prompt, local, load, params)
        if aborted:
            # An aborted request is not pinned (``request_finished`` with FINISHED_ABORTED).
            self._pool.free(block_ids)
            kv_params = None
        else:
            kv_params = self._finish(
                request, params, block_ids, seq, num_cached, tracked=not untracked
            )
            if kv_params is not None and load.tier is not None:
                kv_params = with_tier_load(kv_params, load.tier)  # AgentKVConnector too
        return EngineResult(
            token_ids=generation.token_ids,
            finish_reason=generation.finish_reason,
            num_cached_tokens=num_cached,
            num_cache_creation_tokens=max(0, full_blocks_after_prefill - num_cached),
            kv_transfer_params=kv_params,
            stop_reason=None if hit is None else hit.stop_string,
            text=None if hit is None else hit.text,
        )

    def _connector_load(
        self,
        params: dict[str, Any] | None,
        prompt: list[int],
        hashes: list[int],
        local: int,
        *,
        salt: str | None = None,
    ) -> _Load:
        """``get_num_new_matched_tokens`` + ``update_state_after_alloc`` + the worker's read."""
        if not params:
            return _Load()
        n_prompt = len(prompt)
        has_handle = bool(params.get("remote_block_ids")) and all(k in params for k in _HANDLE_KEYS)
        if params.get("do_remote_prefill"):
            count = n_prompt - local
            if count > 0 and not has_handle:
                # vLLM asserts here and the engine core dies; the fake only fails the request.
                raise EngineError("do_remote_prefill without a complete remote handle")
        elif (
            params.get("do_remote_decode")
            and not params.get("remote_block_ids")
            and self._tier is not None
            and self._book is not None
        ):
            return self._tier_load(params, prompt, hashes, local, salt)
        elif params.get("do_remote_decode") and has_handle:
            remote_num_tokens = params.get("remote_num_tokens") or 0
            count = min(int(remote_num_tokens), n_prompt) - local
            threshold = self.config.kv_recompute_threshold
            if threshold > 0 and count < threshold:
                count = 0
        else:
            return _Load()
        if count <= 0:
            self._notify_only(params)
            return _Load()
        try:
            return self._pull(params, prompt, hashes, local, count)
        except _KVLoadError as exc:
            if self.config.kv_load_failure_policy == "fail":
                raise EngineError("Internal server error") from exc
            return _Load()

    def _tier_load(
        self,
        params: dict[str, Any],
        prompt: list[int],
        hashes: list[int],
        local: int,
        salt: str | None,
    ) -> _Load:
        """``TierScheduler.lookup`` + the worker's checked read: the prompt's prefix that the
        tier entry holds token for token, beyond the local prefix cache."""
        try:
            ref = TierRef.from_params(params)
        except HintError:
            return _Load()  # the connector logs tier_ref_ignored
        if ref is None or self._tier is None:
            return _Load()
        bs = self.config.block_size
        n, contents, reason = self._tier.match(
            ref, prompt=prompt, cache_salt=salt, first_block=local // bs
        )
        if reason == "ok" and n <= local:
            reason = "cached"  # prefill's own prefix cache held it all
        report = TierLoadReport(tokens=n, reason=reason)
        if n <= local:
            return _Load(tier=report)
        first = local // bs
        loaded = contents[first:]
        for i, content in enumerate(loaded):
            need = min(bs, n - (first + i) * bs)
            del content.tokens[need:]
        if not all(is_true_content(c, prompt, first + i, hashes, bs) for i, c in enumerate(loaded)):
            self._fabric.record_wrong_reuse(self)
        return _Load(blocks=loaded, num_tokens=n - local, tier=report)

    def _notify_only(self, params: dict[str, Any]) -> None:
        """A full local hit (or a pull below threshold) still tells the producer to free."""
        if not (params.get("remote_block_ids") and all(k in params for k in _HANDLE_KEYS)):
            return
        producer = self._handshake(params)
        if producer is not None:
            producer.on_remote_read(params["remote_request_id"])

    def _handshake(self, params: dict[str, Any]) -> FakeEngine | None:
        producer = self._fabric.lookup(params["remote_host"], params["remote_port"])
        if producer is None or producer.engine_id != params["remote_engine_id"]:
            self.stats.nixl_failed_transfers.inc()
            return None
        return producer

    def _pull(
        self,
        params: dict[str, Any],
        prompt: list[int],
        hashes: list[int],
        local: int,
        count: int,
    ) -> _Load:
        bs = self.config.block_size
        producer = self._handshake(params)
        if producer is None:
            raise _KVLoadError("handshake failed")
        expiry = params.get("remote_blocks_expiry_time")
        if (
            self.config.bidirectional_kv_xfer
            and isinstance(expiry, int | float)
            and self._clock() + EXPIRY_SAFETY_MARGIN_S >= expiry
        ):
            self.stats.nixl_kv_expired_reqs.inc()
            raise _KVLoadError("declining expired remote read")
        groups = params["remote_block_ids"]
        remote_ids = groups[0] if isinstance(groups, list) and isinstance(groups[0], list) else []
        n_blocks = -(-(local + count) // bs) - local // bs
        if len(remote_ids) < n_blocks:
            raise EngineError("remote handle has fewer blocks than the tokens to load")
        wanted = remote_ids[len(remote_ids) - n_blocks :]
        # Strict: a pull of blocks the producer no longer pins for that request reads memory that
        # may be handed to another request at any moment. vLLM cannot tell; its content may still
        # look right, so the fake counts the read itself as wrong KV.
        stale = not producer.holds(params["remote_request_id"], wanted)
        try:
            contents = [producer.read_block(b) for b in wanted]
        except IndexError as exc:
            self.stats.nixl_failed_transfers.inc()
            raise _KVLoadError(str(exc)) from exc
        producer.on_remote_read(params["remote_request_id"])
        self.stats.record_transfer(
            num_bytes=n_blocks * bs * BYTES_PER_TOKEN, num_descriptors=n_blocks * 60
        )
        first = local // bs
        used = local + count
        for i, content in enumerate(contents):
            need = min(bs, used - (first + i) * bs)
            del content.tokens[need:]
            # A block that holds fewer tokens than claimed is garbage KV for the rest.
            content.tokens += [_GARBAGE] * (need - len(content.tokens))
        if stale or not all(
            is_true_content(c, prompt, first + i, hashes, bs) for i, c in enumerate(contents)
        ):
            self._fabric.record_wrong_reuse(self)
        return _Load(blocks=contents, num_tokens=count)

    def _store(
        self,
        blocks: list[BlockContent],
        seq: list[int],
        prompt_hashes: list[int],
        local_ids: list[int],
    ) -> list[int]:
        """Write the request's KV into pool blocks and register full blocks for prefix reuse."""
        bs = self.config.block_size
        n_blocks = -(-len(seq) // bs)
        self._pool.touch(local_ids)
        try:
            new_ids = self._pool.allocate(n_blocks - len(local_ids))
        except Exception:
            self._pool.free(local_ids)
            raise
        block_ids = local_ids + new_ids
        hashes = list(prompt_hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        for start in range(len(hashes) * bs, len(seq) - bs + 1, bs):
            parent = chain(parent, seq[start : start + bs])
            hashes.append(parent)
        for index in range(len(local_ids), n_blocks):
            self._pool.write(block_ids[index], blocks[index])
            if index < len(hashes):
                self._pool.cache(block_ids[index], hashes[index])
        return block_ids

    def _finish(
        self,
        request: EngineRequest,
        params: dict[str, Any] | None,
        block_ids: list[int],
        seq_tokens: list[int],
        num_cached: int,
        *,
        tracked: bool = True,
    ) -> dict[str, Any] | None:
        """``request_finished``: keep the blocks for a remote reader and describe them."""
        num_computed = len(seq_tokens)
        is_producer = bool(params and params.get("do_remote_decode"))
        if not params or (not is_producer and not self.config.bidirectional_kv_xfer):
            self._pool.free(block_ids)
            return None
        ttl = self.config.kv_lease_duration if is_producer else self.config.decoder_kv_blocks_ttl
        deadline = self._clock() + ttl
        # NixlPullConnector.request_finished: keep the blocks until the deadline, describe them.
        self._pins[request.request_id] = _Pin(
            block_ids,
            deadline,
            turn_end=not is_producer,
            tokens=() if is_producer else tuple(seq_tokens),
            cache_salt=request.cache_salt,
            tracked=tracked,
        )
        heapq.heappush(self._deadlines, (deadline, request.request_id))
        out = self._handle_params(
            request,
            block_ids,
            producer=is_producer,
            num_tokens=num_computed,
            expiry=None if is_producer else deadline,
        )
        if is_producer:
            out["remote_prefill_cached_tokens"] = num_cached
            return out
        if self._book is None:
            return out
        # AgentKVConnector._apply_policy: the same function, on this engine's pins.
        _, answer = apply_pin_policy(
            self._book,
            self,
            request_id=request.request_id,
            params=params,
            result=(True, out),
            default_ttl_s=ttl,
        )
        return answer

    # PinControl (AgentKVConnector's view of vLLM's NIXL scheduler fields).
    def set_deadline(self, request_id: str, deadline: float) -> None:
        self._set_deadline(request_id, deadline)

    def unpin(self, request_id: str) -> None:
        pin = self._pins.pop(request_id, None)
        if pin is not None:
            self._pool.free(pin.block_ids)

    def _handle_params(
        self,
        request: EngineRequest,
        block_ids: list[int],
        *,
        producer: bool,
        num_tokens: int,
        expiry: float | None,
    ) -> dict[str, Any]:
        """``NixlConnector.request_finished``'s returned params describing the kept blocks."""
        return {
            "do_remote_prefill": producer,
            "do_remote_decode": not producer,
            "remote_block_ids": [list(block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": expiry,
            "transfer_mode": "pull",
        }

    def _account(
        self,
        generation: Generation,
        n_prompt: int,
        local: int,
        load: _Load,
        params: dict[str, Any] | None,
    ) -> None:
        stats = self.stats
        stats.prompt_tokens.inc(n_prompt)
        stats.generation_tokens.inc(len(generation.token_ids))
        stats.prefix_cache_queries.inc(n_prompt)
        stats.prefix_cache_hits.inc(local)
        if params:
            stats.external_prefix_cache_queries.inc(n_prompt - local)
            stats.external_prefix_cache_hits.inc(load.num_tokens)
        stats.prompt_tokens_cached.inc(local + load.num_tokens)
        stats.request_success[generation.finish_reason].inc()


def _salted(hashes: list[int], salt: str | None) -> list[int]:
    """Prefix-cache keys under ``salt`` (the unsalted keys when there is none)."""
    if salt is None:
        return hashes
    return [hash((key, salt)) for key in hashes]
