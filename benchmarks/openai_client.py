"""The openai drop-in's cost: ``agentkv.AsyncOpenAI`` versus ``AsyncSession`` directly.

One process, the fake pair in it (``FakeCluster.transport``, no sockets): the same conversations
run on both paths,

* direct: ``AsyncSession.send(question)`` on an ``AsyncCluster``;
* drop-in: ``agentkv.AsyncOpenAI(cluster).chat.completions.with_raw_response.create(...)``,
  re-sending the whole history each call and echoing the answer, as openai-SDK code does, with
  ``session_id=`` on the client;

a ~CONTEXT-token system prompt, then TURNS turns, CONCURRENCY sessions at a time, the two paths
alternating in rounds so that drifting machine load weighs on both alike. Columns:

* direct / drop-in: per-call latency (median);
* added: per drop-in call, its latency minus the SDK's turn inside it (the app's
  ``Server-Timing: turn``): the openai client (request building, response parsing into pydantic
  models), the in-process transport and the proxy's mapping, measured on each call. At high
  concurrency it also holds the wait for the event loop, which other sessions' turns share;
* openai floor: the openai SDK's own work per call, with no agentkv in it: a plain
  ``openai.AsyncOpenAI`` sending the same growing histories to an ASGI app that answers a canned
  completion at once, on the same in-process transport. Any openai-SDK code pays this (against
  api.openai.com too): validating and transforming ``messages`` grows with the history;
* agentkv added: added minus the floor: what the drop-in costs beyond the openai SDK itself
  (the transport, Starlette, the proxy's parsing and session mapping);
* the second table splits each call at its transport, timed per call by the httpx2 client's own
  event hooks (which run right before and after the transport): the transport side (its time
  minus the turn in it: the in-process transport and the proxy app; for the floor, the canned
  app) and the SDK side (the latency minus the transport's time: the openai SDK building the
  request and parsing the answer). agentkv added is the sum of the two differences to the floor:
  the same quantity as in the first table, from per-call medians of each side instead of the
  difference of two whole-call medians, so one noisy side does not move the other;
* in-app: the proxy app's own work per call (``Server-Timing: proxy``: parsing and validating the
  request, mapping it onto its session, building the answer), part of agentkv added;
* CPU/call: this process's CPU seconds per call on each path; CPU added is drop-in minus direct
  (the fake pair's own CPU is in both), and agentkv CPU is that minus the openai floor's CPU per
  call: agentkv's own cost per call whatever the concurrency. (At 16 and 64 sessions the latency
  columns mostly measure queueing: every session's turn, the fake pair's included, shares this
  process's one event loop.)

    .venv/bin/python benchmarks/openai_client.py [--concurrency 1,16,64] [--turns 6]
        [--context 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai
import orjson
import structlog

import agentkv
from agentkv import AsyncCluster
from agentkv._openai.transport import AsyncAppTransport
from agentkv.proxy import ProxyConfig
from agentkv.testing import FakeCluster

TRANSPORT_S = "bench_transport_s"


async def _sent(request: httpx2.Request) -> None:
    request.extensions["bench_sent"] = time.perf_counter()


async def _received(response: httpx2.Response) -> None:
    # The hooks run right before and after the transport: the time between is the transport's.
    sent = response.request.extensions["bench_sent"]
    response.extensions[TRANSPORT_S] = time.perf_counter() - sent


def _time_transport(client: openai.AsyncOpenAI) -> None:
    """Time each call's transport with the httpx2 client's own event hooks."""
    client._client.event_hooks = {"request": [_sent], "response": [_received]}


def _system_prompt(fake: FakeCluster, tokens: int) -> str:
    sentence = "agents reuse the decode node's cache so every later turn starts warm "
    text = ""
    while len(fake.tokenizer.encode(text)) < tokens:
        text += sentence
    return text


def _question(session: int, turn: int) -> str:
    return f"Question {turn} of session {session}: what should the agent do next?"


@dataclass
class Samples:
    latency_s: list[float] = field(default_factory=list)
    added_s: list[float] = field(default_factory=list)
    in_app_s: list[float] = field(default_factory=list)
    # Per call: the time inside the transport minus the turn in it (the app's side), and the
    # latency minus the time inside the transport (the openai SDK's side: building the request,
    # parsing the answer into its models).
    app_side_s: list[float] = field(default_factory=list)
    sdk_side_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    calls: int = 0


async def _direct(cluster: AsyncCluster, system: str, index: int, turns: int, out: Samples) -> None:
    async with cluster.session(max_tokens=32) as session:
        session.append(agentkv.Message.system(system))
        for turn in range(turns):
            started = time.perf_counter()
            await session.send(_question(index, turn))
            out.latency_s.append(time.perf_counter() - started)


async def _drop_in(
    client: agentkv.AsyncOpenAI, system: str, index: int, turns: int, out: Samples
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    session = f"bench-{index}-{time.perf_counter_ns()}"
    for turn in range(turns):
        messages.append({"role": "user", "content": _question(index, turn)})
        started = time.perf_counter()
        raw = await client.chat.completions.with_raw_response.create(
            model=client.model,
            messages=messages,
            max_tokens=32,
            extra_headers={"X-Session-ID": session},
        )
        reply = raw.parse()
        elapsed = time.perf_counter() - started
        out.latency_s.append(elapsed)
        timing = dict(
            part.strip().split(";dur=") for part in raw.headers["server-timing"].split(",")
        )
        out.added_s.append(elapsed - float(timing["turn"]) / 1e3)
        out.in_app_s.append(float(timing["proxy"]) / 1e3)
        in_transport = raw.http_response.extensions[TRANSPORT_S]
        out.app_side_s.append(in_transport - float(timing["turn"]) / 1e3)
        out.sdk_side_s.append(elapsed - in_transport)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    await client.delete(f"/sessions/{session}", cast_to=object)


def _canned_app(model: str) -> Any:
    body = orjson.dumps(
        {
            "id": "chatcmpl-canned",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            # The drop-in's answer shape (as vLLM's), so that the SDK parses the same models.
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "canned " * 24, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 1,
                "completion_tokens": 32,
                "total_tokens": 33,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "system_fingerprint": None,
        }
    )
    headers = [(b"content-type", b"application/json"), (b"server-timing", b"turn;dur=0")]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _floor_client(model: str) -> openai.AsyncOpenAI:
    @asynccontextmanager
    async def nothing() -> AsyncIterator[None]:
        yield

    transport = AsyncAppTransport(_canned_app(model), model=model, lifespan=nothing)
    return openai.AsyncOpenAI(
        api_key="k",
        base_url="http://canned/v1",
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=transport),
    )


async def _floor(
    client: openai.AsyncOpenAI, system: str, index: int, turns: int, out: Samples
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": _question(index, turn)})
        started = time.perf_counter()
        # The same calls as the drop-in's: the raw response, parsed, its timing header read.
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=32, extra_headers={"X-Session-ID": "x"}
        )
        reply = raw.parse()
        dict(part.strip().split(";dur=") for part in raw.headers["server-timing"].split(","))
        elapsed = time.perf_counter() - started
        out.latency_s.append(elapsed)
        in_transport = raw.http_response.extensions[TRANSPORT_S]
        out.app_side_s.append(in_transport)
        out.sdk_side_s.append(elapsed - in_transport)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))


async def _round(
    run: Any, target: Any, *, concurrency: int, turns: int, out: Samples, system: str
) -> None:
    cpu = time.process_time()
    await asyncio.gather(*(run(target, system, i, turns, out) for i in range(concurrency)))
    out.cpu_s += time.process_time() - cpu
    out.calls += concurrency * turns


async def _level(args: argparse.Namespace, concurrency: int) -> dict[str, float]:
    fake = FakeCluster(pairs=2)
    system = _system_prompt(fake, args.context)
    direct, drop_in, floor = Samples(), Samples(), Samples()
    async with (
        AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster,
        agentkv.AsyncOpenAI(
            cluster, config=ProxyConfig(max_sessions=100_000), max_retries=0
        ) as client,
        _floor_client(fake.model) as canned,
    ):
        _time_transport(client)
        _time_transport(canned)
        # Warm every path (templates, the app's lifespan, pydantic's validators).
        await _round(_direct, cluster, concurrency=2, turns=2, out=Samples(), system=system)
        await _round(_drop_in, client, concurrency=2, turns=2, out=Samples(), system=system)
        await _round(_floor, canned, concurrency=2, turns=2, out=Samples(), system=system)
        # The paths alternate, so that drifting machine load weighs on all of them alike. The
        # floor runs one conversation at a time: its latency is the SDK's work, not a queue.
        for _ in range(args.rounds):
            await _round(
                _direct,
                cluster,
                concurrency=concurrency,
                turns=args.turns,
                out=direct,
                system=system,
            )
            await _round(
                _drop_in,
                client,
                concurrency=concurrency,
                turns=args.turns,
                out=drop_in,
                system=system,
            )
            for _ in range(max(1, concurrency // 4)):
                await _round(
                    _floor, canned, concurrency=1, turns=args.turns, out=floor, system=system
                )
    return {
        "direct_ms": statistics.median(direct.latency_s) * 1e3,
        "drop_in_ms": statistics.median(drop_in.latency_s) * 1e3,
        "added_ms": statistics.median(drop_in.added_s) * 1e3,
        "added_p90_ms": statistics.quantiles(drop_in.added_s, n=10)[-1] * 1e3,
        "floor_ms": statistics.median(floor.latency_s) * 1e3,
        "in_app_ms": statistics.median(drop_in.in_app_s) * 1e3,
        "app_side_ms": statistics.median(drop_in.app_side_s) * 1e3,
        "floor_app_side_ms": statistics.median(floor.app_side_s) * 1e3,
        "sdk_side_ms": statistics.median(drop_in.sdk_side_s) * 1e3,
        "floor_sdk_side_ms": statistics.median(floor.sdk_side_s) * 1e3,
        "cpu_direct_ms": direct.cpu_s / direct.calls * 1e3,
        "cpu_floor_ms": floor.cpu_s / floor.calls * 1e3,
        "cpu_drop_in_ms": drop_in.cpu_s / drop_in.calls * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(
        "| sessions | direct median | drop-in median | added median (p90) "
        "| openai floor | agentkv added | in-app | CPU/call direct | CPU/call drop-in | CPU added "
        "| agentkv CPU |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    results = []
    for level in (int(c) for c in args.concurrency.split(",")):
        r = asyncio.run(_level(args, level))
        results.append((level, r))
        print(
            f"| {level} | {r['direct_ms']:.2f} ms | {r['drop_in_ms']:.2f} ms "
            f"| {r['added_ms']:.3f} ms ({r['added_p90_ms']:.3f}) | {r['floor_ms']:.3f} ms "
            f"| {r['added_ms'] - r['floor_ms']:.3f} ms | {r['in_app_ms']:.3f} ms "
            f"| {r['cpu_direct_ms']:.3f} ms "
            f"| {r['cpu_drop_in_ms']:.3f} ms | {r['cpu_drop_in_ms'] - r['cpu_direct_ms']:.3f} ms "
            f"| {r['cpu_drop_in_ms'] - r['cpu_direct_ms'] - r['cpu_floor_ms']:.3f} ms |",
            flush=True,
        )
    print()
    print(
        "| sessions | transport side: drop-in (minus turn) | floor | difference "
        "| SDK side: drop-in | floor | difference | agentkv added (sum of differences) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for level, r in results:
        app = r["app_side_ms"] - r["floor_app_side_ms"]
        sdk = r["sdk_side_ms"] - r["floor_sdk_side_ms"]
        print(
            f"| {level} | {r['app_side_ms']:.3f} ms | {r['floor_app_side_ms']:.3f} ms "
            f"| {app:.3f} ms | {r['sdk_side_ms']:.3f} ms | {r['floor_sdk_side_ms']:.3f} ms "
            f"| {sdk:.3f} ms | {app + sdk:.3f} ms |"
        )


if __name__ == "__main__":
    main()
