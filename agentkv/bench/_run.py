"""One benchmark run: calibrate, build the workload, run every (session, mode) lane, report."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx2

from agentkv import AgentKVError, ConfigError, MalformedResponseError
from agentkv._core import HttpxPoster, dumps, get_logger, post_json
from agentkv.bench._config import BenchConfig, Mode
from agentkv.bench._decode_watch import DEFAULT_INTERVAL_S, DecodeWatch, watch_decode
from agentkv.bench._env import environment, server_cache
from agentkv.bench._modes import ClusterTarget, NotOwned, SessionRunner, open_runner
from agentkv.bench._report import build_report
from agentkv.bench._roles import role_report, session_roles
from agentkv.bench._samples import TurnSample
from agentkv.bench._schedule import Lane, interleave, run_lanes
from agentkv.bench._share import SharedClusters
from agentkv.bench._trace import ReplayPlan, build_trace_workload
from agentkv.bench._workload import (
    SessionScript,
    TokenCounter,
    TurnScript,
    Workload,
    build_workload,
    calibrate,
)

__all__ = ["METHOD", "TRACE_METHOD", "run_bench", "session_id"]

logger = get_logger("agentkv.bench")

OnTurn = Callable[[TurnSample], None]

# How the numbers were obtained, recorded in every report.
METHOD = {
    "ttft": "request to first generated token, streamed decode; includes rendering the new "
    "messages' tokens, the P leg (prefill and any pull from decode) and the D leg's first token",
    "ttft_streamed": True,
    "reused_tokens": "prefill server's usage.prompt_tokens_details.cached_tokens",
    "ideal_reused_tokens": "previous turn's prompt + generated tokens - 1",
    "disagg": "no handle; a fresh vLLM cache_salt on every P leg (prefill's cache cold for the "
    "session); decode does not pin turn-end KV (agentkv pin hint false)",
    "affinity": "no handle; one cache_salt per session on both legs (prefill keeps the "
    "session's own prefix cache); decode does not pin turn-end KV",
    "agentkv": "agentkv SDK with the default CachePolicy; one cache_salt per session on both "
    "legs; the pin extended to cover each pause",
    "tier": "as agentkv, but at each pause the turn-end KV is offloaded to decode's file tier "
    "(session.offload(): decode's pin freed) and the next turn's prefill loads it from there",
    "pauses": "think time after every turn but the last, times time_scale in real time; the SDK "
    "is told the full length",
    "aggregated": "streamed chat completions to the prefill server alone; one cache_salt per "
    "session; the server renders the messages",
    "limit": "each turn's exact prompt ids (the SDK's transcript and template) in one request "
    "to the decode server alone, no P leg, nothing transferred or pinned; before each turn >= 2, "
    "off the clock, a one-token request of the previous turn's prompt and output fills its "
    "prefix cache (whole blocks only: up to block_size - 1 old tokens are recomputed); "
    "reused_tokens is the decode server's cached_tokens",
    "isolation": "each (mode, session) has its own cache_salt prefix, so no mode or session hits "
    "another's cache, and none hits an earlier run's",
    "output_length": "every turn generates exactly its planned tokens (min_tokens = max_tokens)",
    "interleaving": "round-robin over (session, mode) lanes, mode order rotated per session",
    "decode_metrics": "each decode server's /metrics every interval_s (and at each phase's "
    "start and end): vllm:kv_cache_usage_perc (peak and mean) and vllm:num_preemptions_total "
    "(added during the phase); a phase is a mode with serial_modes, else the whole run",
    "evictions": "SDK modes: turns >= 2 whose decode handle could not be used (handle_state "
    "expired, consumed, invalidated or diverged); tier_resumes: turns that loaded the "
    "session's KV from decode's file tier, tier_shortfalls: those that reused less than the "
    "tier held",
}
# Replaces METHOD's entries with pause="tool-wait" and with serial_modes.
TOOL_WAIT_METHOD = {
    "agentkv": "agentkv SDK with the default CachePolicy; one cache_salt per session on both "
    "legs; each pause is session.tool_wait(expected_s=pause, offload='auto'), open until the "
    "next turn: the policy keeps the pin (extended if the pause outlasts it) or offloads it to "
    "decode's file tier (a pause >= persist_after_s, or decode's KV usage >= persist_kv_usage)",
}
SERIAL_METHOD = {
    "interleaving": "modes one after another, each with decode to itself; within a mode, "
    "round-robin over its sessions",
}
# Added to METHOD when the workload is a replayed trace.
TRACE_METHOD = {
    "trace": "sessions from the trace (named, or inferred from hash-id prefixes); each hash id is "
    "a fixed text chunk of one block (length_scale x the trace's block size, in the served "
    "model's tokens); a turn's user text is the trace's prompt growth over the previous prompt "
    "and output; outputs at the trace's lengths x length_scale",
    "pauses": "each session starts at its first request's timestamp; after a turn, the trace's "
    "think time, or the gap to the next request less the request's assumed original service "
    "time (never negative); both times time_scale in real time, the SDK told the full length",
    "subagents": "each subagent of a kv-cache-tester conversation is its own session, started "
    "at the conversation's start plus its t, concurrently with its siblings and parent; the "
    "sessions of one conversation share one cache_salt (one user) in every mode that keeps one "
    "per session (disagg: still fresh per P leg)",
}


def session_id(mode: Mode, session: int) -> str:
    """The SDK session id of ``session`` in ``mode`` (as ``open_runner`` names it)."""
    return f"{mode.value}-s{session}"


class _Tokenizer:
    """Counts tokens with the prefill server's ``/tokenize`` (the served model's tokenizer)."""

    def __init__(self, client: httpx2.AsyncClient, target: ClusterTarget) -> None:
        self._client = client
        self._poster = HttpxPoster(client)
        self._url = target.urls("prefill")[0] + "/tokenize"
        self._model = target.model

    async def count(self, text: str) -> int:
        body = dumps({"model": self._model, "prompt": text, "add_special_tokens": False})
        data = await post_json(self._poster, self._url, body, summary="tokenize")
        count = data.get("count") if isinstance(data, Mapping) else None
        if type(count) is not int:
            raise MalformedResponseError("unexpected tokenize answer", url=self._url,
                                         detail="no integer 'count'")
        return count


async def _first_turn_ideal(count: TokenCounter, script: SessionScript, system_tokens: int) -> int:
    """What a replayed session's first turn may find cached from an earlier session of its
    conversation: the system prompt and the text its first message shares (``_roles``)."""
    shared = 0 if script.origin is None else script.origin.shared_chars
    if not shared or not script.turns:
        return 0
    return system_tokens + await count(script.turns[0].user[:shared])


class _Lanes:
    """Builds the lanes of a run and records their samples."""

    def __init__(self, config: BenchConfig, target: ClusterTarget, workload: Workload,
                 on_turn: OnTurn | None, *, modes: tuple[Mode, ...]) -> None:
        self.config = config
        self.modes = modes
        self.samples: list[TurnSample] = []
        self.runners: list[SessionRunner] = []
        self._closed: set[int] = set()
        self._clusters = SharedClusters()  # a salt group's sessions: one client (``_share``)
        self._target = target
        self._workload = workload
        self._on_turn = on_turn

    def build(self) -> list[Lane]:
        lanes = []
        for session, mode in interleave(self.config.sessions, self.modes):
            script = self._workload.sessions[session]
            runner = open_runner(mode, session, target=self._target, system=self._workload.system,
                                 run_id=self.config.run_id, stream=self.config.stream,
                                 pause=self.config.pause, salt_group=script.salt_group,
                                 clusters=self._clusters)
            self.runners.append(runner)
            lanes.append(Lane(session=session, mode=mode,
                              turns=list(self._workload.sessions[session].turns),
                              run=self._runner(runner, session, mode,
                                               last=self._workload.sessions[session].turns[-1]),
                              start_s=self._workload.sessions[session].start_s))
        return lanes

    def _runner(
        self, runner: SessionRunner, session: int, mode: Mode, *, last: TurnScript
    ) -> Callable[[TurnScript], Awaitable[bool]]:
        async def run(script: TurnScript) -> bool:
            try:
                sample = await runner.turn(script)
            except AgentKVError as exc:
                sample = TurnSample(mode=mode, session=session, turn=script.turn, ttft_s=0.0,
                                    total_s=0.0, prompt_tokens=0, reused_tokens=0,
                                    ideal_reused_tokens=0, generated_tokens=0,
                                    error=f"{type(exc).__name__}: {exc}")
            if sample.ok and script.turn < self.config.turns and script.think_time_s > 0:
                held = await runner.pause(script.think_time_s)
                sample = dataclasses.replace(
                    sample,
                    paused_decode_tokens=held.decode_tokens,
                    paused_tier_tokens=held.tier_tokens,
                )
            sid = session_id(mode, session)
            if not sample.ok:
                logger.warning("agentkv.bench.turn_failed", mode=mode.value, session_id=sid,
                               turn=script.turn, error=sample.error)
            else:
                prefill = sample.prefill_s
                logger.info(
                    "agentkv.bench.turn",
                    mode=mode.value,
                    session_id=sid,
                    turn=script.turn,
                    ttft_ms=round(sample.ttft_s * 1000, 3),
                    prefill_ms=None if prefill is None else round(prefill * 1000, 3),
                    total_ms=round(sample.total_s * 1000, 3),
                    prompt_tokens=sample.prompt_tokens,
                    reused_tokens=sample.reused_tokens,
                    ideal_reused_tokens=sample.ideal_reused_tokens,
                    handle_state=sample.handle_state,
                )
            self.samples.append(sample)
            if self._on_turn is not None:
                self._on_turn(sample)
            if not sample.ok or script is last:
                # The agent is done: its session closes (decode's pin of its last turn freed)
                # now, as a real agent's does, not when the whole run ends.
                await self._close(runner)
            return sample.ok

        return run

    async def _close(self, runner: SessionRunner) -> None:
        if id(runner) not in self._closed:
            self._closed.add(id(runner))
            await runner.aclose()

    async def aclose(self) -> None:
        for runner in self.runners:
            await self._close(runner)
        await self._clusters.aclose()


async def _run_phases(
    config: BenchConfig,
    target: ClusterTarget,
    workload: Workload,
    on_turn: OnTurn | None,
    watch: DecodeWatch,
) -> list[TurnSample]:
    """Run the lanes, all modes interleaved or (``serial_modes``) one mode after another, with
    decode's metrics sampled through each phase; a phase's sessions are closed (their pins
    released) before the next one starts."""
    phases = ([(mode.value, (mode,)) for mode in config.modes] if config.serial_modes
              else [("run", config.modes)])
    samples: list[TurnSample] = []
    async with httpx2.AsyncClient(transport=NotOwned(target.transport), timeout=10.0) as client:
        for phase, modes in phases:
            lanes = _Lanes(config, target, workload, on_turn, modes=modes)
            try:
                async with watch_decode(client, watch, phase=phase):
                    await run_lanes(
                        lanes.build(), concurrency=config.concurrency,
                        time_scale=config.time_scale,
                    )
            finally:
                await lanes.aclose()
            samples.extend(lanes.samples)
    return samples


async def run_bench(
    config: BenchConfig,
    *,
    target: ClusterTarget,
    on_turn: OnTurn | None = None,
    replay: ReplayPlan | None = None,
    decode_sample_s: float = DEFAULT_INTERVAL_S,
) -> dict[str, Any]:
    """Run the benchmark on ``target``; returns the JSON report (see ``_report``).

    ``on_turn`` is called after every turn (the CLI's progress bar). A failed turn is recorded in
    the report's ``errors`` and ends its lane; the other lanes go on. ``replay`` (a planned trace,
    ``agentkv.bench._trace.plan_replay``) replaces the synthetic sessions; ``config.sessions`` and
    ``config.turns`` must then be its session count and longest session. Decode's KV usage and
    preemptions are sampled every ``decode_sample_s`` seconds (``_decode_watch``).
    """
    if replay is not None and (config.sessions, config.turns) != (
        len(replay.sessions), replay.max_turns
    ):
        raise ConfigError(
            f"a trace replay of {len(replay.sessions)} sessions and at most {replay.max_turns} "
            f"turns needs sessions={len(replay.sessions)}, turns={replay.max_turns}"
        )
    async with httpx2.AsyncClient(transport=NotOwned(target.transport), timeout=60.0) as client:
        tokenizer = _Tokenizer(client, target)
        ratios = await calibrate(tokenizer.count, seed=config.seed)
        workload = (build_workload(config, ratios) if replay is None
                    else build_trace_workload(replay, ratios))
        system_tokens = await tokenizer.count(workload.system)
        roles = None
        if any(s.origin is not None for s in workload.sessions):
            ideals = [await _first_turn_ideal(tokenizer.count, s, system_tokens)
                      for s in workload.sessions]
            roles = session_roles(workload, ideals)
        caches = {
            f"{name}/{role}": await server_cache(client, url)
            for role in ("prefill", "decode")
            for name, url in target.servers(role)
        }
    logger.info(
        "agentkv.bench.start",
        modes=[m.value for m in config.modes],
        sessions=config.sessions,
        turns=config.turns,
        context_tokens=config.context_tokens,
        system_tokens=system_tokens,
        run_id=config.run_id,
    )
    watch = DecodeWatch(servers=tuple(dict.fromkeys(target.urls("decode"))),
                        interval_s=decode_sample_s)
    samples = await _run_phases(config, target, workload, on_turn, watch)
    method = dict(METHOD) if replay is None else {**METHOD, **TRACE_METHOD}
    if config.pause == "tool-wait":
        method.update(TOOL_WAIT_METHOD)
    if config.serial_modes:
        method.update(SERIAL_METHOD)
    if not config.stream:
        method["ttft"] = ("request to the end of a non-streamed turn (whole decode included): "
                          "NOT time to first token")
        method["ttft_streamed"] = False
    env = {
        **environment(target),
        "server_caches": caches,
        "workload": {
            **({"kind": "synthetic"} if replay is None else replay.summary()),
            "system_prompt_tokens": system_tokens,
            "chars_per_token": {k: round(v, 4) for k, v in ratios.items()},
        },
        "method": method,
    }
    report = build_report(config, samples, environment=env, decode=watch, pooled=target.pooled)
    if roles is not None:
        report.update(role_report(config.modes, samples, roles))
    logger.info("agentkv.bench.done", errors=len(report.get("errors", ())),
                summary={m: b["summary"] for m, b in report["modes"].items()})
    return report
