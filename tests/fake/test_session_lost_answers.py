"""D legs whose answer the SDK never got: released by the request id the SDK chose (issue 15.4).

Decode finished and pinned the turn's KV, but the handle (and its lease secret) was in the
answer that was lost. Each D leg is sent with ``X-Request-Id: agentkv-<sha256(secret)>``; the
SDK releases by presenting the secret. Facts are read from the fake decode server.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from agentkv import (
    AsyncCluster,
    Cluster,
    ConnectionLostError,
    MalformedResponseError,
    Message,
    RequestTimeoutError,
    RetryPolicy,
    ServerError,
)
from agentkv._wire.hints import REQUEST_TAG_PREFIX, request_tag
from agentkv.testing import FakeCluster

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}


pytestmark = pytest.mark.fake(pairs=1)


def open_cluster(fake, clock, attempts=1):
    return Cluster.from_dict(
        fake.cluster_spec,
        transport=fake.transport,
        clock=clock,
        block_size=16,
        retry=RetryPolicy(max_attempts=attempts, initial_backoff_s=0, jitter_s=0),
    )


def test_every_d_leg_is_sent_with_a_request_id_of_the_sdks_choosing(fake, clock):
    with open_cluster(fake, clock) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        s.send("And of Spain?", **LONG)
        ids = [h.get("x-request-id") for h in fake.decode(0).request_headers]
        assert len(ids) == 2
        assert all(i is not None and i.startswith(REQUEST_TAG_PREFIX) for i in ids)
        assert ids[0] != ids[1]
        # vLLM's engine request id (what the handle names) is built from it.
        assert s.handle is not None
        assert s.handle.request_id.startswith(f"chatcmpl-{ids[1]}-")


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        pytest.param("timeout", RequestTimeoutError, id="timeout"),
        pytest.param("reset", ConnectionLostError, id="reset"),
        pytest.param("malformed_json", MalformedResponseError, id="malformed_json"),
        pytest.param("truncated_json", MalformedResponseError, id="truncated_json"),
    ],
)
def test_a_d_leg_whose_answer_is_lost_leaves_no_pin(fake, clock, fault, error):
    with open_cluster(fake, clock) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        fake.decode(0).fail_next(fault)
        with pytest.raises(error):
            s.send("And of Spain?", **LONG)
        s.close()
    assert fake.decode(0).pinned_handles == 0
    assert fake.decode(0).leased_handles == 0


def test_a_retried_d_leg_leaves_only_the_pin_of_the_answer_that_arrived(fake, clock):
    with open_cluster(fake, clock, attempts=3) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        fake.decode(0).fail_next("timeout")
        r = s.send("And of Spain?", **LONG)
        assert r.stats.retries == 1
        s.close()  # waits for the release of the lost leg; then releases the session's pin
        assert fake.decode(0).pinned_handles == 0
        assert fake.decode(0).leased_handles == 0


def test_while_the_session_lives_only_its_own_pin_is_left(fake, clock):
    with open_cluster(fake, clock, attempts=3) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        fake.decode(0).fail_next("timeout")
        s.send("And of Spain?", **LONG)
        s.send("And of Italy?", **LONG)  # the lost leg's release ran meanwhile
        assert fake.decode(0).pinned_handles == 1  # the session's own handle, nothing else
        assert fake.decode(0).leased_handles == 1


def test_a_stream_left_after_decode_finished_leaves_no_pin(fake, clock):
    with open_cluster(fake, clock) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        s.append(Message.user("And of Spain?"))
        for _ in s.stream(**LONG):
            break
        s.close()
    assert fake.decode(0).pinned_handles == 0


async def test_an_async_stream_left_or_a_turn_cancelled_leaves_no_pin(fake, clock):
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16,
        retry=RetryPolicy(max_attempts=1),
    ) as cluster:
        async with cluster.session() as s:
            s.append(SYSTEM)
            await s.send("What is the capital of France?", **LONG)
            s.append(Message.user("And of Spain?"))
            async for _ in s.stream(**LONG):
                break
        assert fake.decode(0).pinned_handles == 0
        assert fake.decode(0).pinned_handles == 0


class AnswerHeld(httpx2.AsyncBaseTransport):
    """Decode answers, but its answer never reaches the client while ``hold`` is set."""

    def __init__(self, fake: FakeCluster) -> None:
        self.fake = fake
        self.inner = fake.transport
        self.hold = False
        self.held = asyncio.Event()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        decode = self.fake.server(str(request.url)).role == "decode"
        if self.hold and decode and request.url.path.endswith("/completions"):
            self.held.set()
            await asyncio.Event().wait()  # until cancelled
        return response


async def test_a_turn_cancelled_after_decode_finished_leaves_no_pin(fake, clock):
    transport = AnswerHeld(fake)
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=transport, clock=clock, block_size=16,
        retry=RetryPolicy(max_attempts=1),
    ) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        await s.send("What is the capital of France?", **LONG)
        transport.hold = True
        task = asyncio.ensure_future(s.send("And of Spain?", **LONG))
        await transport.held.wait()
        assert fake.decode(0).pinned_handles == 1  # the held turn's (the P leg read the first)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        transport.hold = False
        await s.aclose()
        assert fake.decode(0).pinned_handles == 0


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        pytest.param("status", ServerError, id="status"),
        pytest.param("malformed_json", MalformedResponseError, id="malformed_json"),
    ],
)
def test_a_handle_carried_by_a_p_leg_that_prefill_answered_with_an_error_is_released(
    fake, clock, fault, error
):
    """Prefill answered: it is done with the handle (it pulled it or never will); the SDK
    dropped it as consumed, so decode would keep it for its whole TTL."""
    with open_cluster(fake, clock) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        assert fake.decode(0).pinned_handles == 1
        fake.prefill(0).fail_next(fault, status=503)
        with pytest.raises(error):
            s.send("And of Spain?", **LONG)
        assert fake.decode(0).pinned_handles == 0
        assert fake.wrong_reuse_events == 0


def test_a_handle_left_behind_when_the_session_moves_off_a_dead_prefill_is_released(clock):
    """Found by the fuzzer: another session (here the health check) found the pair's prefill
    dead; this session moved to the other pair and dropped its handle, but the old pair's decode
    was alive and kept the pin for its whole TTL."""
    fake = FakeCluster(pairs=2, clock=clock)
    with open_cluster(fake, clock, attempts=3) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        old = s.pair
        assert fake.server(old.decode).pinned_handles == 1
        fake.server(old.prefill).kill()
        cluster.check_health()  # marks the pair down, as another session's turn would
        result = s.send("And of Spain?", **LONG)
        assert s.pair.name != old.name
        assert result.stats.handle_state.value == "invalidated"
        assert fake.server(old.decode).pinned_handles == 0
        assert fake.wrong_reuse_events == 0


def test_a_handle_past_our_deadline_but_still_pinned_is_released_at_close(fake, clock):
    """Found by the fuzzer: our deadline keeps a margin before decode's; a session closed inside
    that margin skipped the release and decode kept the pin until its own deadline."""
    with open_cluster(fake, clock) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", **LONG)
        handle = s.handle
        assert handle is not None
        clock.advance(handle.deadline - clock() + 0.5)  # past ours, before decode's 480 s
        assert fake.decode(0).pinned_handles == 1
    assert fake.decode(0).pinned_handles == 0


def test_a_turn_tags_its_d_leg_with_a_callers_secret_and_the_cluster_releases_by_it(fake, clock):
    """``request_secret``: a caller that recorded the secret elsewhere before the turn (a proxy
    replica, in its session store) frees the turn's pin by it when the answer is never stored,
    and a release that comes before the leg ends keeps decode from pinning anything for it."""
    with open_cluster(fake, clock) as cluster, cluster.session() as s:
        s.append(SYSTEM)
        s.send("What is the capital of France?", request_secret="s3cret", **LONG)
        assert fake.decode(0).request_headers[-1]["x-request-id"] == request_tag("s3cret")
        assert fake.decode(0).pinned_handles == 1
        assert cluster.release_request("s3cret") == 1
        assert fake.decode(0).pinned_handles == 0
        assert cluster.release_request("early") == 1  # no such leg yet: remembered
        s.send("And of Spain?", request_secret="early", **LONG)
        assert fake.decode(0).pinned_handles == 0
        assert s.handle is None
