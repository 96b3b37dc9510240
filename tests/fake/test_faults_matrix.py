"""The fault matrix on the fake pair: servers dying between and during turns, handles that are
gone, inputs that cannot be sent. Every case ends with the right answer or a typed error, and the
transcript holds each assistant message exactly once.

Cases already covered elsewhere are listed in ``docs/reliability.md`` with their tests (5xx,
timeouts, resets, malformed answers on both legs: ``test_session_faults.py``).
"""

from __future__ import annotations

import json

import httpx2
import pytest

from agentkv import (
    Cluster,
    ContextLengthError,
    HandleState,
    InvalidMessageError,
    Message,
    RetryPolicy,
    Session,
)
from agentkv.testing import FakeCluster, FakeServer

SYSTEM = Message.system("You are a helpful assistant. Answer in one or two sentences. " * 4)
LONG = {"max_tokens": 100, "extra_body": {"min_tokens": 70}}
FIRST = "What is the capital of France? Tell me about its history."
SECOND = "And Spain?"
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0, jitter_s=0)
CHAT = "/v1/chat/completions"


class KillAfter(httpx2.AsyncBaseTransport):
    """Passes requests to the fake; kills ``victim`` right after ``server`` answers a chat request.

    That is a server dying in the middle of a turn, between its two legs.
    """

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner
        self.server: FakeServer | None = None
        self.victim: FakeServer | None = None

        self.cut: FakeServer | None = None
        self.cut_kills = False
        self.cut_reply: str = "lost"

    def arm(self, *, after: FakeServer, kill: FakeServer) -> None:
        self.server, self.victim = after, kill

    def arm_cut(self, server: FakeServer, *, kill: bool, reply: str = "lost") -> None:
        """Fail ``server``'s next chat request, killing the server if ``kill``: the connection is
        lost (``reply="lost"``) or the answer is a 500 (``"500"``, what vLLM's API server says
        when its engine died under the request)."""
        self.cut, self.cut_kills, self.cut_reply = server, kill, reply

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        cut = self.cut
        if cut is not None and request.url.path == CHAT and str(request.url).startswith(cut.url):
            self.cut = None
            if self.cut_kills:
                cut.kill()
            if self.cut_reply == "500":
                message = "EngineCore encountered an issue. See stack trace (above)."
                error = {"message": message, "type": "InternalServerError", "code": 500}
                return httpx2.Response(500, json={"error": error}, request=request)
            # What httpx2 raises when the server goes away before answering.
            raise httpx2.RemoteProtocolError("Server disconnected without sending a response.")
        response = await self._inner.handle_async_request(request)
        server, victim = self.server, self.victim
        if (
            server is not None
            and victim is not None
            and request.url.path == CHAT
            and str(request.url).startswith(server.url)
        ):
            self.server = self.victim = None
            victim.kill()
        return response


pytestmark = pytest.mark.cluster(manual_clock=True, block_size=16, retry=FAST_RETRY)


@pytest.fixture
def killer(fake):
    return KillAfter(fake.transport)


@pytest.fixture
def transport(killer):
    """The SDK reaches the fake through the killer."""
    return killer


def servers(fake, session):
    return fake.server(session.pair.prefill), fake.server(session.pair.decode)


def started(cluster, session_id="s"):
    s = cluster.session(session_id=session_id, **LONG)
    s.append(SYSTEM)
    s.send(FIRST)
    assert s.handle is not None
    return s


def reference(clock):
    """Turn 2's answer on a healthy cluster."""
    fake = FakeCluster(pairs=1, clock=clock)
    with Cluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock) as cluster:
        return started(cluster).send(SECOND).token_ids


def assert_intact(session: Session, turns: int) -> None:
    """Every user message answered exactly once: no duplicate, no missing assistant message."""
    roles = [m.role for m in session.transcript.messages]
    assert roles == ["system", *["user", "assistant"] * turns]
    assert len(session.turns) == turns
    assert session.transcript.pending == ()


def test_decode_killed_between_turns_moves_the_session_and_recomputes(cluster, fake, clock):
    s = started(cluster)
    old = s.pair
    servers(fake, s)[1].kill()
    result = s.send(SECOND)
    assert s.pair != old
    # prefill's pull from the dead decode failed with a 500 (the handle is spent); the probe
    # that follows finds decode dead, so the one retry runs on the other pair
    assert result.stats.handle_state is HandleState.CONSUMED
    assert result.stats.retries == 1
    assert result.stats.pulled_tokens == 0  # the KV was recomputed on the new pair
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0


def test_decode_killed_mid_turn_reruns_the_turn_on_a_healthy_pair(cluster, fake, clock, killer):
    s = started(cluster)
    old = s.pair
    prefill, decode = servers(fake, s)
    killer.arm(after=prefill, kill=decode)  # prefill answered, then decode died
    result = s.send(SECOND)
    assert s.pair != old
    assert result.stats.retries >= 1
    assert result.stats.pulled_tokens == 0
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize("reply", ["lost", "500"])
def test_a_decode_dying_under_its_leg_moves_the_session_on_the_first_retry(
    cluster, fake, clock, killer, reply
):
    """The connection is lost, or the answer is a 500, not a refused connection: the pair's
    /health is probed at once, so the retry goes to a healthy pair instead of running a whole P
    leg into the dead decode again."""
    s = started(cluster)
    old = s.pair
    killer.arm_cut(servers(fake, s)[1], kill=True, reply=reply)
    result = s.send(SECOND)
    assert s.pair != old
    assert result.stats.retries == 1
    assert result.stats.pulled_tokens == 0
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0


@pytest.mark.parametrize("reply", ["lost", "500"])
def test_a_failure_of_a_live_decode_is_retried_on_the_same_pair(
    cluster, fake, clock, killer, reply
):
    s = started(cluster)
    old = s.pair
    killer.arm_cut(servers(fake, s)[1], kill=False, reply=reply)
    result = s.send(SECOND)
    assert s.pair == old
    assert result.stats.retries == 1
    assert result.stats.handle_state is HandleState.CONSUMED  # the first P leg may have read it
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0


def test_prefill_killed_mid_turn_reruns_the_turn_on_a_healthy_pair(cluster, fake, clock, killer):
    s = started(cluster)
    old = s.pair
    prefill, _ = servers(fake, s)
    killer.arm(after=prefill, kill=prefill)  # decode must now pull from a dead prefill
    result = s.send(SECOND)
    assert s.pair != old
    assert result.stats.retries >= 1
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0


def test_prefill_killed_between_turns_moves_the_session_and_recomputes(cluster, fake, clock):
    s = started(cluster)
    servers(fake, s)[0].kill()
    result = s.send(SECOND)
    assert result.stats.handle_state is HandleState.INVALIDATED
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_server_restarted_between_turns_serves_the_next_turn_on_the_same_pair(clock, role):
    """One pair only. A restarted decode lost its pin: the pull fails, the turn re-runs without
    the handle and recomputes. A restarted prefill lost only its own cache: decode's pin is
    still good and is pulled."""
    fake = FakeCluster(pairs=1, clock=clock)
    with Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, retry=FAST_RETRY
    ) as cluster:
        s = started(cluster)
        server = fake.prefill(0) if role == "prefill" else fake.decode(0)
        server.kill()
        server.restart()
        result = s.send(SECOND)
        assert s.pair.name == "pair-0"
        assert result.token_ids == reference(clock)
        if role == "decode":
            assert result.stats.handle_state is HandleState.CONSUMED
            assert result.stats.retries == 1
            assert result.stats.pulled_tokens == 0  # prefill's own cache still helps
        else:
            assert result.stats.handle_state is HandleState.ATTACHED
            assert result.stats.reused_tokens == result.stats.ideal_reused_tokens
        assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0


def test_an_expired_handle_is_left_out_and_the_answer_equals_a_no_reuse_run(cluster, clock):
    s = started(cluster)
    clock.advance(3600.0)
    result = s.send(SECOND)
    assert result.stats.handle_state is HandleState.EXPIRED
    assert result.token_ids == reference(clock)
    assert_intact(s, 2)


@pytest.mark.parametrize(
    "bad",
    [
        {"role": "user", "content": "caf\udce9"},  # bytes decoded with surrogateescape
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 1}}],
        },
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]},
        {"role": "user", "content": b"bytes"},
    ],
)
def test_unsendable_messages_are_refused_before_anything_changes(cluster, bad):
    s = started(cluster)
    before = s.transcript
    with pytest.raises(InvalidMessageError):
        s.send(bad)
    with pytest.raises(InvalidMessageError):
        s.append_history([*before.messages, bad])
    assert s.transcript == before
    assert s.send(SECOND).text  # the session carries on


def test_an_oversized_request_is_a_context_length_error_and_loses_nothing(clock):
    fake = FakeCluster(pairs=1, clock=clock, max_model_len=400)
    with Cluster.from_dict(fake.cluster_spec, transport=fake.transport, clock=clock) as cluster:
        s = started(cluster)
        before = s.transcript
        s.append(Message.user("word " * 500))
        with pytest.raises(ContextLengthError):
            s.turn()
        assert s.transcript.messages == before.messages
        assert len(s.transcript.pending) == 1  # still queued: the caller decides what to drop
        with pytest.raises(ContextLengthError):
            s.send("word " * 500)
        assert len(s.transcript.pending) == 1  # send() took back only its own message


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_kv_pull_that_cannot_reach_decode_still_answers_and_the_stats_say_so(
    clock, tmp_path, policy
):
    """NIXL pull failure (decode's side channel unreachable). With vLLM's
    ``kv_load_failure_policy=fail`` prefill answers 500 and the SDK re-runs the turn without the
    handle; with ``recompute`` prefill recomputes in the same request."""
    fake = FakeCluster(pairs=1, clock=clock, kv_load_failure_policy=policy)
    with Cluster.from_dict(
        fake.cluster_spec, transport=fake.transport, clock=clock, block_size=16, retry=FAST_RETRY
    ) as cluster:
        path = tmp_path / "s.json"
        started(cluster).save(path)
        data = json.loads(path.read_text())
        data["kv"]["handle"]["port"] += 1000  # a side channel nobody listens on
        path.write_text(json.dumps(data))
        s = Session.load(path, cluster)
        result = s.send(SECOND)
        assert result.token_ids == reference(clock)
        assert result.stats.pulled_tokens == 0
        assert result.stats.reused_tokens < result.stats.ideal_reused_tokens
        if policy == "fail":
            assert result.stats.retries == 1
            assert result.stats.handle_state is HandleState.CONSUMED
        else:
            assert result.stats.retries == 0
            assert result.stats.handle_state is HandleState.ATTACHED
        assert_intact(s, 2)
    assert fake.wrong_reuse_events == 0
