"""The lease routes on decode: HTTP in, engine utility call, lease book, HTTP out (no vLLM needed).

The engine side is the real code (``_engine_rpc.agentkv_leases`` and ``LeaseService``); only the
transport between API server and EngineCore is a fake that calls it in-process.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI

from agentkv._wire.hints import (
    CLAIM_PATH,
    EXTEND_PATH,
    INFO_PATH,
    RELEASE_PATH,
    ExtendResult,
    LeaseRef,
    ServerInfo,
)
from agentkv.connector._endpoint import AgentKVEndpointPlugin
from agentkv.connector._engine_rpc import METHOD, agentkv_leases
from agentkv.connector._leases import LeaseBook, LeaseService

BLOCKS = ((7, 8),)


class Clock:
    now = 500.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Engine:
    """One EngineCore: its connector serves lease calls, unless it is stock vLLM's."""

    clock: Clock
    stock: bool = False
    deadlines: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.book = LeaseBook(clock=self.clock, max_ttl_s=600)
        service = LeaseService(self.book, set_deadline=self.deadlines.__setitem__,
                               clock=self.clock, default_ttl_s=480)
        self.connector = object() if self.stock else type(
            "Connector", (), {"agentkv_lease_op": staticmethod(service.handle)})()
        self.scheduler = self

    def get_kv_connector(self) -> object:
        return self.connector

    @property
    def model_executor(self) -> object:
        return type("Executor", (), {"collective_rpc": staticmethod(lambda *a, **k: [])})()

    def pin(self, request_id: str) -> LeaseRef:
        _, ack = self.book.grant(request_id, BLOCKS, ttl_s=60)
        assert ack.lease is not None
        return LeaseRef(request_id=request_id, block_ids=BLOCKS, lease=ack.lease)


@dataclass
class Core:
    """The API server's engine client: one utility call per engine, as vLLM's DP client does."""

    engines: list[Engine]
    missing_method: bool = False

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return (await self.call_utility_all_async(method, *args))[0]

    async def call_utility_all_async(self, method: str, op: str, payload: Any) -> list[Any]:
        assert method == METHOD
        if self.missing_method:
            raise RuntimeError(f"Call to {METHOD} method failed: 'EngineCoreProc' object has no "
                               f"attribute '{METHOD}'")
        return [agentkv_leases(engine, op, payload) for engine in self.engines]


@dataclass
class EngineClient:
    engine_core: Core


async def _client(core: Core) -> AsyncIterator[httpx2.AsyncClient]:
    app = FastAPI()
    plugin = AgentKVEndpointPlugin()
    plugin.attach_router(app)
    await plugin.init_state(EngineClient(core), app.state, Namespace())
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://d") as c:
        yield c


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(clock: Clock) -> Engine:
    return Engine(clock)


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx2.AsyncClient]:
    async for c in _client(Core([engine])):
        yield c


async def test_info_says_leases_are_served(client: httpx2.AsyncClient) -> None:
    info = ServerInfo.from_wire((await client.get(INFO_PATH)).json())
    assert info == ServerInfo(leases=True, stream_handles=False, default_ttl_s=480.0,
                              max_ttl_s=600.0)


async def test_release_frees_at_the_next_step_and_only_once(
    client: httpx2.AsyncClient, engine: Engine
) -> None:
    ref = engine.pin("req-1")
    response = await client.post(RELEASE_PATH, json=ref.to_wire())
    assert response.status_code == 200
    assert response.json() == {"released": True}
    assert engine.deadlines["req-1"] < engine.clock()  # a past deadline: freed at the next step
    again = await client.post(RELEASE_PATH, json=ref.to_wire())
    assert again.status_code == 404
    assert again.json()["error"]["code"] == "unknown_lease"


async def test_someone_elses_or_a_guessed_handle_is_refused(
    client: httpx2.AsyncClient, engine: Engine
) -> None:
    mine, theirs = engine.pin("req-mine"), engine.pin("req-theirs")
    forged = [
        {**theirs.to_wire(), "lease": mine.lease},
        {**theirs.to_wire(), "remote_block_ids": [[7, 9]]},
        {**mine.to_wire(), "remote_request_id": "req-unknown"},
    ]
    for body in forged:
        assert (await client.post(RELEASE_PATH, json=body)).status_code == 404
        assert (await client.post(EXTEND_PATH, json={**body, "ttl_s": 30})).status_code == 404
    assert engine.deadlines == {}


async def test_extend_answers_the_new_deadline(
    client: httpx2.AsyncClient, engine: Engine, clock: Clock
) -> None:
    ref = engine.pin("req-1")
    clock.now += 50
    response = await client.post(EXTEND_PATH, json={**ref.to_wire(), "ttl_s": 300})
    assert response.status_code == 200
    assert response.json() == {"remote_blocks_expiry_time": 850.0, "ttl_s": 300.0}
    assert engine.deadlines == {"req-1": 850.0}


async def test_claim_answers_a_new_secret_and_voids_the_old_one(
    client: httpx2.AsyncClient, engine: Engine, clock: Clock
) -> None:
    ref = engine.pin("req-1")
    clock.now += 50
    response = await client.post(CLAIM_PATH, json={**ref.to_wire(), "ttl_s": 300})
    assert response.status_code == 200
    result = ExtendResult.from_wire(response.json())
    assert (result.expiry, result.ttl_s) == (850.0, 300.0)
    assert result.lease is not None
    assert result.lease != ref.lease
    assert engine.deadlines == {"req-1": 850.0}
    for path in (CLAIM_PATH, EXTEND_PATH):
        again = await client.post(path, json={**ref.to_wire(), "ttl_s": 300})
        assert again.status_code == 404
        assert again.json()["error"]["code"] == "unknown_lease"
    mine = {**ref.to_wire(), "lease": result.lease}
    assert (await client.post(RELEASE_PATH, json=mine)).status_code == 200


async def test_an_expired_lease_answers_410(
    client: httpx2.AsyncClient, engine: Engine, clock: Clock
) -> None:
    ref = engine.pin("req-1")
    clock.now += 61
    response = await client.post(EXTEND_PATH, json={**ref.to_wire(), "ttl_s": 300})
    assert response.status_code == 410
    assert response.json()["error"]["code"] == "lease_expired"


@pytest.mark.parametrize("body", [None, [], {"remote_request_id": "r"},
                                  {"remote_request_id": "r", "remote_block_ids": [[1]]}])
async def test_a_malformed_body_answers_400(client: httpx2.AsyncClient, body: object) -> None:
    response = await client.post(RELEASE_PATH, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    bad_json = await client.post(RELEASE_PATH, content=b"{", headers={"content-type": "x"})
    assert bad_json.status_code == 400


async def test_with_data_parallel_engines_the_owner_answers(clock: Clock) -> None:
    first, second = Engine(clock), Engine(clock)
    ref = second.pin("req-on-2")
    async for client in _client(Core([first, second])):
        assert (await client.post(RELEASE_PATH, json=ref.to_wire())).status_code == 200
    assert list(second.deadlines) == ["req-on-2"]
    assert first.deadlines == {}


async def test_a_stock_connector_answers_501_and_info_says_no_leases(clock: Clock) -> None:
    ref = LeaseRef(request_id="r", block_ids=BLOCKS, lease="s")
    for core in (Core([Engine(clock, stock=True)]), Core([Engine(clock)], missing_method=True)):
        async for client in _client(core):
            response = await client.post(RELEASE_PATH, json=ref.to_wire())
            assert response.status_code == 501
            assert response.json()["error"]["code"] == "leases_unavailable"
            assert (await client.get(INFO_PATH)).json()["leases"] is False


async def test_offload_without_a_tier_answers_501_tier_unavailable(
    client: httpx2.AsyncClient, engine: Engine
) -> None:
    """The fake connector has no ``agentkv_tier_op`` at all: a connector without a tier method
    is not agentkv's (leases_unavailable); agentkv's without a tier dir says tier_unavailable."""
    from agentkv._wire.tier import LEGACY_OFFLOAD_PATH, TIER_DELETE_PATH

    ref = engine.pin("req-p")
    response = await client.post(LEGACY_OFFLOAD_PATH, json=ref.to_wire())
    assert response.status_code == 501
    assert response.json()["error"]["code"] == "leases_unavailable"
    engine.connector.agentkv_tier_op = (  # type: ignore[attr-defined]
        lambda op, payload, run: {"status": "tier_unavailable"})
    response = await client.post(LEGACY_OFFLOAD_PATH, json=ref.to_wire())
    assert response.status_code == 501
    assert response.json()["error"]["code"] == "tier_unavailable"
    response = await client.post(TIER_DELETE_PATH, json={"id": "../../etc/passwd"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


async def test_a_failed_offload_answers_500_and_names_the_cause(
    client: httpx2.AsyncClient, engine: Engine
) -> None:
    from agentkv._wire.tier import LEGACY_OFFLOAD_PATH

    engine.connector.agentkv_tier_op = (  # type: ignore[attr-defined]
        lambda op, payload, run: {"status": "tier_failed", "message": "disk full"})
    response = await client.post(LEGACY_OFFLOAD_PATH, json=engine.pin("req-f").to_wire())
    assert response.status_code == 500
    assert response.json() == {"error": {"code": "tier_write_failed", "message": "disk full"}}


async def test_offload_polls_the_engine_until_the_workers_write_is_committed(
    client: httpx2.AsyncClient, engine: Engine
) -> None:
    """The engine starts the write and answers ``pending``; the route asks again (each a short
    utility call between engine steps) until the commit, and answers its reference."""
    from agentkv._wire.tier import LEGACY_OFFLOAD_PATH

    calls: list[tuple[str, object]] = []
    polls = iter([{"status": "pending", "entry": "e1"}] * 3
                 + [{"status": "ok", "tier": {"id": "e1"}}])

    def tier_op(op: str, payload: object, run: object) -> dict[str, object]:
        calls.append((op, payload))
        return {"status": "pending", "entry": "e1"} if op == "offload" else next(polls)

    engine.connector.agentkv_tier_op = tier_op  # type: ignore[attr-defined]
    response = await client.post(LEGACY_OFFLOAD_PATH, json=engine.pin("req-w").to_wire())
    assert response.status_code == 200, response.text
    assert response.json() == {"tier": {"id": "e1"}}
    assert [op for op, _ in calls] == ["offload"] + ["offload_poll"] * 4
    assert all(payload == {"entry": "e1"} for _, payload in calls[1:])


async def test_a_write_that_fails_after_it_started_answers_500(
    client: httpx2.AsyncClient, engine: Engine
) -> None:
    from agentkv._wire.tier import LEGACY_OFFLOAD_PATH

    def tier_op(op: str, payload: object, run: object) -> dict[str, object]:
        if op == "offload":
            return {"status": "pending", "entry": "e2"}
        return {"status": "tier_failed", "message": "tier write failed: disk full"}

    engine.connector.agentkv_tier_op = tier_op  # type: ignore[attr-defined]
    response = await client.post(LEGACY_OFFLOAD_PATH, json=engine.pin("req-x").to_wire())
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "tier_write_failed"


@pytest.mark.parametrize("name", ["legacy", "new"])
async def test_the_offload_route_answers_under_its_first_and_its_new_name(
    client: httpx2.AsyncClient, engine: Engine, name: str
) -> None:
    """SDKs of any version post to ``.../leases/persist`` (a wire contract, kept); connectors from
    issue 41 on serve the same call at ``.../leases/offload`` too."""
    from agentkv._wire.tier import LEGACY_OFFLOAD_PATH, OFFLOAD_PATH

    ops: list[str] = []

    def tier_op(op: str, payload: object, run: object) -> dict[str, object]:
        ops.append(op)
        return {"status": "ok", "tier": {"id": "e3"}}

    engine.connector.agentkv_tier_op = tier_op  # type: ignore[attr-defined]
    path = {"legacy": LEGACY_OFFLOAD_PATH, "new": OFFLOAD_PATH}[name]
    response = await client.post(path, json=engine.pin("req-n").to_wire())
    assert response.status_code == 200, response.text
    assert response.json() == {"tier": {"id": "e3"}}
    assert ops == ["offload"]
    assert LEGACY_OFFLOAD_PATH == "/v1/agentkv/leases/persist"  # the contract: never changes
