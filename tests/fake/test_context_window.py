"""A turn's context window: max_tokens clamped to what the prompt leaves (or refused), a prompt
that does not fit refused before any leg, and the servers' own context 400s as the same error."""

from __future__ import annotations

import pytest
import structlog

from agentkv import Cluster, ContextLengthError, TextDelta, TurnResult
from agentkv.testing import FakeCluster

WINDOW = 512


pytestmark = pytest.mark.fake(pairs=1, max_model_len=WINDOW)


def _decode_requests(fake: FakeCluster) -> int:
    return len(fake.decode(0).requests)


def test_an_oversized_max_tokens_is_clamped_to_what_the_prompt_leaves(cluster):
    """Agents send max_tokens 32000 to an 8k model; vLLM would answer 400, the turn clamps."""
    with cluster.session() as s, structlog.testing.capture_logs() as logs:
        result = s.send("hello", max_tokens=32000)
    stats = result.stats
    assert stats.max_tokens == WINDOW - stats.prompt_tokens
    assert stats.max_tokens_clamped_from == 32000
    clamped = [e for e in logs if e["event"] == "agentkv.max_tokens_clamped"]
    assert clamped
    assert clamped[0]["asked"] == 32000
    assert clamped[0]["given"] == stats.max_tokens
    assert clamped[0]["log_level"] == "info"


def test_a_max_tokens_that_fits_runs_as_asked_and_says_nothing(cluster):
    with cluster.session() as s, structlog.testing.capture_logs() as logs:
        result = s.send("hello", max_tokens=8)
    assert result.stats.max_tokens == 8
    assert result.stats.max_tokens_clamped_from is None
    assert not [e for e in logs if e["event"] == "agentkv.max_tokens_clamped"]


def test_refuse_raises_before_any_leg_and_keeps_the_session(cluster, fake):
    with cluster.session(max_tokens=8) as s:
        s.send("hello")
        before = (len(s.turns), _decode_requests(fake), s.handle)
        with pytest.raises(ContextLengthError) as caught:
            s.send("more", max_tokens=32000, oversized_max_tokens="refuse")
        err = caught.value
        assert err.max_tokens == 32000
        assert err.limit == WINDOW
        assert 0 < err.prompt_tokens < WINDOW
        assert (len(s.turns), _decode_requests(fake), s.handle) == before
        # The session goes on: the same message, asking for what fits.
        assert s.send("more").stats.turn == 2


def test_a_prompt_that_leaves_no_room_is_refused_even_when_clamping(cluster, fake):
    with cluster.session() as s, pytest.raises(ContextLengthError) as caught:
        s.send("word " * 2000, max_tokens=8)
    assert caught.value.max_tokens is None
    assert caught.value.prompt_tokens >= WINDOW == caught.value.limit
    assert _decode_requests(fake) == 0


def test_a_stream_says_the_clamp_with_its_first_delta(cluster):
    with cluster.session() as s:
        s.append({"role": "user", "content": "hello"})
        events = list(s.stream(max_tokens=32000))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    result = events[-1]
    assert isinstance(result, TurnResult)
    assert deltas[0].max_tokens_clamped_from == 32000
    assert deltas[0].max_tokens == result.stats.max_tokens == WINDOW - result.stats.prompt_tokens
    assert all(d.max_tokens_clamped_from is None for d in deltas[1:])


def test_a_cluster_file_max_model_len_is_a_fallback_not_an_override(fake):
    """The servers' own answer wins over a stale cluster file."""
    spec = {**fake.cluster_spec, "max_model_len": 100_000}
    with Cluster.from_dict(spec, transport=fake.transport) as cluster, cluster.session() as s:
        result = s.send("hello", max_tokens=32000)
    assert result.stats.max_tokens == WINDOW - result.stats.prompt_tokens


@pytest.mark.parametrize(
    ("message", "asked"),
    [
        (
            "max_tokens=32000 cannot be greater than max_model_len=512. Please request fewer "
            "output tokens.",
            32000,
        ),
        (
            "This model's maximum context length is 512 tokens. However, your prompt contains "
            "at least 513 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            None,
        ),
        ("Input length (600) exceeds model's maximum context length (512).", None),
    ],
)
def test_the_servers_own_context_400s_are_a_context_length_error(cluster, fake, message, asked):
    """In case the client-side count and the server's differ."""
    fake.decode(0).fail_next("status", status=400, message=message)
    with cluster.session() as s, pytest.raises(ContextLengthError) as caught:
        s.send("hello", max_tokens=8)
    assert caught.value.max_tokens == asked
    assert caught.value.limit == WINDOW
    assert caught.value.__cause__ is not None


def test_other_400s_stay_bad_requests(cluster, fake):
    from agentkv import BadRequestError

    fake.decode(0).fail_next("status", status=400, message="temperature must be non-negative")
    with cluster.session() as s, pytest.raises(BadRequestError):
        s.send("hello", max_tokens=8)


def test_oversized_max_tokens_is_checked(cluster):
    from agentkv import ConfigError

    with cluster.session() as s, pytest.raises(ConfigError):
        s.send("hello", oversized_max_tokens="truncate")
