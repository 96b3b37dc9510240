"""``AgentKVConnector``: vLLM's NIXL pull connector (transfer code unchanged) + agentkv pin policy.

vLLM pins every finished D-leg request's blocks for a fixed ``decoder_kv_blocks_ttl``. Here, on
the scheduler side (the EngineCore process), the request's persist hint decides instead: pin for
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

from agentkv.connector import _engine_rpc, _quiet
from agentkv.connector._leases import LeaseBook, LeaseService, SchedulerPins, apply_pin_policy

# Longest pin a hint or extend may ask for, unless kv_connector_extra_config sets
# "agentkv_max_ttl_s": a runaway lease must not hold decode memory forever.
DEFAULT_MAX_TTL_S = 3600.0


class AgentKVConnector(NixlPullConnector):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's NixlConnector (pull mode, unchanged transfer code) with agentkv's pin policy.

    Extra config (``kv_connector_extra_config``) besides vLLM's: ``agentkv_max_ttl_s`` caps hinted
    and extended leases (default 3600 s). ``decoder_kv_blocks_ttl`` stays the TTL of requests
    without a hint.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The worker builds its NIXL agent inside super().__init__: quiet it first, in case the
        # general plugin was not enabled in this process.
        _quiet.apply()
        super().__init__(*args, **kwargs)
        self._book: LeaseBook | None = None
        self._control: SchedulerPins | None = None
        self._service: LeaseService | None = None
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
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return result

    # --- scheduler side: the pin policy ----------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._apply_policy(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._apply_policy(request, super().request_finished_all_groups(request, block_ids))

    def _apply_policy(
        self, request: Any, result: tuple[bool, dict[str, Any] | None]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._book is None or self._control is None:
            return result
        return apply_pin_policy(
            self._book,
            self._control,
            request_id=request.request_id,
            params=request.kv_transfer_params,
            result=result,
            default_ttl_s=self._default_ttl_s,
        )

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._book is not None:
            self._book.forget(connector_output.finished_sending or ())

    # --- scheduler side: lease calls (EngineCore utility, see _engine_rpc) -----------------------

    def agentkv_lease_op(self, op: str, payload: object) -> dict[str, object]:
        """Serve one lease call; runs on the EngineCore thread, between engine steps."""
        if self._service is None:
            return {"status": "unavailable"}
        return self._service.handle(op, payload)
