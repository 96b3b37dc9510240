"""``AgentKVConnector``: vLLM's NIXL pull connector (transfer code unchanged) + agentkv pin policy.

vLLM pins every finished D-leg request's blocks for a fixed ``decoder_kv_blocks_ttl``. Here, on
the scheduler side (the EngineCore process), the request's pin hint decides instead: pin for
the SDK's TTL, or free the blocks at once; and the lease routes (``_endpoint``) reach
:meth:`AgentKVConnector.agentkv_lease_op` through an EngineCore utility call to release or extend
a pin early.

Both act through the one channel vLLM already has for this: the per-request deadline that the
scheduler hands its workers each step (``reqs_to_send``). The worker keeps the latest deadline of
a request it has not yet served and frees the blocks once it passes; a past deadline therefore
frees them at the next step, a later one keeps them. Prefill reads, heartbeats and expiry run
exactly as in vLLM.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from agentkv._core import get_logger
from agentkv._wire.hints import HintError
from agentkv._wire.tier import OffloadRequest, TierRef, with_tier_load
from agentkv.connector import _engine_rpc, _quiet
from agentkv.connector._leases import (
    LeaseBook,
    LeaseService,
    Outcome,
    SchedulerPins,
    apply_pin_policy,
)
from agentkv.connector._stats import AgentKVConnectorStats, AgentKVPromMetrics
from agentkv.connector._tier import RunOnWorkers, TierScheduler, TierWorker, tier_config
from agentkv.connector._tier_io import cpu_attn_clear_slots_of
from agentkv.connector._tier_stats import TIER_STATS_KEY, tier_reasons

logger = get_logger("agentkv.connector")

# Longest pin a hint or extend may ask for, unless kv_connector_extra_config sets
# "agentkv_max_ttl_s": a runaway lease must not hold decode memory forever.
DEFAULT_MAX_TTL_S = 3600.0


class AgentKVConnector(NixlPullConnector):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's NixlConnector (pull mode, unchanged transfer code) with agentkv's pin policy.

    Extra config (``kv_connector_extra_config``) besides vLLM's: ``agentkv_max_ttl_s`` caps hinted
    and extended leases (default 3600 s). ``decoder_kv_blocks_ttl`` stays the TTL of requests
    without a hint. ``agentkv_tier_dir`` turns on the file tier (``_tier``: offload on decode,
    resume into prefill), ``agentkv_tier_budget_bytes`` bounds it (default 4 GiB), and
    ``agentkv_tier_ttl_s`` / ``agentkv_tier_max_ttl_s`` are its entries' default and longest
    time to live (24 h, 7 days).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The worker builds its NIXL agent inside super().__init__: quiet it first, in case the
        # general plugin was not enabled in this process.
        _quiet.apply()
        super().__init__(*args, **kwargs)
        self._book: LeaseBook | None = None
        self._control: SchedulerPins | None = None
        self._service: LeaseService | None = None
        tier = tier_config(self.kv_transfer_config)
        self._tier_root = tier.dir
        self._tier: TierScheduler | None = None
        self.agentkv_tier_worker: TierWorker | None = None
        self._tier_lost: set[int] = set()  # planned blocks a worker without a tier cannot load
        self._tier_lost_done: set[str] = set()
        if self.connector_scheduler is not None and self._tier_root:
            self._tier = TierScheduler(config=tier, vllm_config=self._vllm_config)
        if self.connector_scheduler is not None:
            # Scheduler role: this runs in the EngineCore process, where lease calls arrive.
            extra = self.kv_transfer_config
            self._default_ttl_s = float(self.connector_scheduler.decoder_kv_blocks_ttl)
            self._book = LeaseBook(
                clock=time.perf_counter,
                max_ttl_s=float(extra.get_from_extra_config("agentkv_max_ttl_s",
                                                            DEFAULT_MAX_TTL_S)),
            )
            self._control = SchedulerPins(self.connector_scheduler)
            self._service = LeaseService(
                self._book,
                set_deadline=self._control.set_deadline,
                clock=time.perf_counter,
                default_ttl_s=self._default_ttl_s,
            )
            _engine_rpc.install()

    # --- scheduler side: one pull per prefill request --------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get("_remote_blocks_processed"):
            # A prefill whose pull from decode already ran once (it failed, e.g. prefill declined
            # an expired handle, or the request was preempted after it) must not pull again: vLLM
            # 0.32 would report the tokens as loadable but never start the transfer (its state
            # says "already processed"), and under kv_load_failure_policy "recompute" the request
            # then waits for that load forever. After a preemption the blocks on decode are
            # freed anyway. Recompute instead.
            return 0, False
        if (
            self._tier is not None
            and params
            and not params.get("remote_block_ids")
            and not params.get("do_remote_prefill")
        ):
            ref = _tier_ref(params)
            if ref is not None:
                n = self._tier.lookup(request, ref, num_computed_tokens)
                return (n, True) if n > 0 else (0, False)
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if self._tier is not None and self._tier.after_alloc(request, blocks,
                                                             num_external_tokens):
            # A tier load: NIXL sees a P leg with nothing to pull (it still sends to decode).
            super().update_state_after_alloc(request, blocks, 0)
            if request.kv_transfer_params is not None:
                # One load per request: a retry after a failed load recomputes.
                request.kv_transfer_params["_remote_blocks_processed"] = True
            return
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._track_local(request)

    def _track_local(self, request: Any) -> None:
        """Have the workers track a local request that vLLM will pin when it finishes.

        With bidirectional transfer on, vLLM pins every finished request that carried params,
        also one that neither pulled nor was prefilled for another server (agentkv's ``decode``
        route: the turn computed on decode itself). But vLLM 0.32 puts only pulling and
        producing requests in ``_reqs_in_batch``, and a worker frees a pinned request's blocks
        (read, expired or released) only if it was in a batch: such a pin would never be freed,
        by a release or by its TTL. Marked here like the others, it is freed as they are.
        """
        scheduler = self.connector_scheduler
        params = request.kv_transfer_params
        if (
            params
            and scheduler.is_bidirectional_kv_xfer_enabled
            and not params.get("do_remote_prefill")
            and not params.get("do_remote_decode")
        ):
            scheduler._reqs_in_batch.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._tier is not None:
            loads = self._tier.take_loads()
            if loads:
                meta.agentkv_tier_loads = loads
        return meta

    # --- worker side: the tier's loads ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        if self._tier_root and self.connector_worker is not None:
            try:
                self.agentkv_tier_worker = TierWorker(
                    root=self._tier_root, kv_caches=kv_caches,
                    num_blocks=int(self._kv_cache_config.num_blocks),
                    rank=int(self.connector_worker.tp_rank),
                    clear_slots=cpu_attn_clear_slots_of(self._vllm_config, kv_caches),
                )
            except RuntimeError as exc:
                logger.warning("tier_worker_unavailable", error=str(exc))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        loads = getattr(self._connector_metadata, "agentkv_tier_loads", None)
        if not loads:
            return
        tier = self.agentkv_tier_worker
        for request_id, load in loads.items():
            if tier is not None:
                tier.load(request_id, load)
            else:  # cannot load: the scheduler recomputes every planned block
                self._tier_lost.update(load.local_blocks)
                self._tier_lost_done.add(request_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        tier = self.agentkv_tier_worker
        if tier is not None:
            # A pin whose blocks are being written to the tier is not freed until the write
            # has ended (_tier_writer): its lease may lapse or a prefill read it meanwhile.
            results.finished_sending = tier.writes.hold(results.finished_sending)
        done = (tier.done if tier is not None else set()) | self._tier_lost_done
        if done:
            results.finished_recving = set(results.finished_recving) | done
            if tier is not None:
                tier.done = set()
            self._tier_lost_done = set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set(super().get_block_ids_with_load_errors())
        tier = self.agentkv_tier_worker
        if tier is not None and tier.invalid:
            errors |= tier.invalid
            tier.invalid = set()
        if self._tier_lost:
            errors |= self._tier_lost
            self._tier_lost = set()
        return errors

    # --- scheduler side: the pin policy ----------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        answer = self._apply_policy(request, super().request_finished(request, block_ids))
        return self._tier_finished(request, answer)

    def request_finished_all_groups(
        self, request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        answer = self._apply_policy(request,
                                    super().request_finished_all_groups(request, block_ids))
        return self._tier_finished(request, answer)

    def _tier_finished(
        self, request: Any, answer: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        """End the tier's state of a request, and put its tier report into prefill's answer.

        vLLM's scheduler calls ``request_finished`` for every request it frees
        (``_free_request``), aborted ones too (``finish_requests``), waiting or running: no
        plan outlives its request.
        """
        if self._tier is None:
            return answer
        report = self._tier.finished(request.request_id)
        delay, params = answer
        if report is None or params is None:
            return answer
        return delay, with_tier_load(params, report)

    def _apply_policy(
        self, request: Any, result: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._book is None or self._control is None:
            return result
        answer = apply_pin_policy(
            self._book,
            self._control,
            request_id=request.request_id,
            params=request.kv_transfer_params,
            result=result,
            default_ttl_s=self._default_ttl_s,
        )
        if self._tier is not None and answer[0] and request.request_id in self._book:
            self._tier.record(request)
        return answer

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._book is not None:
            self._book.forget(connector_output.finished_sending or ())
        if self._tier is not None:
            self._tier.forget(connector_output.finished_sending or ())
            self._tier.load_results(finished=connector_output.finished_recving or (),
                                    invalid=connector_output.invalid_block_ids or ())

    # --- stats: NIXL's and the tier's, to the API server's /metrics (see _tier_stats) -----------

    def get_kv_connector_stats(self) -> Any:
        if self.connector_worker is not None:
            stats = super().get_kv_connector_stats()
            return None if stats is None else AgentKVConnectorStats(data=stats.data)
        reasons = tier_reasons(self._tier.take_outcomes()) if self._tier is not None else []
        return AgentKVConnectorStats(data={TIER_STATS_KEY: reasons}) if reasons else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return AgentKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        return AgentKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler side: lease calls (EngineCore utility, see _engine_rpc) -----------------------

    def agentkv_lease_op(self, op: str, payload: object) -> dict[str, object]:
        """Serve one lease call; runs on the EngineCore thread, between engine steps."""
        if self._service is None:
            return {"status": "unavailable"}
        answer = self._service.handle(op, payload)
        if op == "info" and answer.get("status") == "ok":
            answer["tier"] = None if self._tier is None else {
                **self._tier.store.usage().to_wire(),
                "copy": True,  # an offload with "keep" writes a copy and keeps the pin
            }
        return answer

    def agentkv_tier_op(self, op: str, payload: object,  # noqa: PLR0911 - one answer per case
                        run_on_workers: RunOnWorkers) -> dict[str, object]:
        """Serve a tier call (``offload``, ``offload_poll``, ``tier_delete``); runs on the
        EngineCore thread.

        ``run_on_workers`` is the executor's ``collective_rpc``: the write runs in the workers,
        where the KV tensors are, on threads of their own (``_tier_writer``): ``offload`` starts
        it and ``offload_poll`` commits it once every worker is done, then frees the pin.
        """
        if self._service is None or self._book is None:
            return {"status": "unavailable"}
        if self._tier is None:
            return {"status": "tier_unavailable"}
        if op == "tier_delete":
            return self._tier.delete(payload)
        if op == "offload_poll":
            entry = payload.get("entry") if isinstance(payload, dict) else None
            if not isinstance(entry, str):
                return {"status": "invalid", "message": "offload_poll needs the entry's id"}
            ref = self._tier.offload_ref(entry)
            answer = self._tier.offload_poll(entry, run_on_workers)
            if answer.get("status") == "ok" and ref is not None:
                # Written and committed: now, and only now, free decode's blocks.
                self._service.handle("release", ref.to_wire())
            return answer
        if op != "offload":
            return {"status": "invalid", "message": f"unknown tier operation {op!r}"}
        try:
            request = OffloadRequest.from_wire(payload)
        except HintError as exc:
            return {"status": "invalid", "message": str(exc)}
        ref = request.ref
        outcome, lease = self._book.check(ref)
        if outcome is not Outcome.OK or lease is None:
            return {"status": outcome.value}
        return self._tier.offload(ref, lease.block_ids, run_on_workers, ttl_s=request.ttl_s,
                                  keep=request.keep)


def _tier_ref(params: dict[str, Any]) -> TierRef | None:
    try:
        return TierRef.from_params(params)
    except HintError as exc:
        logger.warning("tier_ref_ignored", error=str(exc))
        return None
