"""A real local 2P1D pool (``agentkv up --prefill 2 --decode 1``): the session stays on its
decode server, its turns run on both prefills, and every turn >= 2 pulls the previous turn's KV
from decode at the ideal, also after the prefill that served the last turn was killed by pid.

The pool is this module's own (ports 19100+, stopped by pid at the end): three more vLLM servers
next to the shared pair do not fit a 2-core CI machine, so the module runs only when
``AGENTKV_POOL_E2E=1`` is set, which ``make test`` does after the shared pair has stopped:

    AGENTKV_POOL_E2E=1 flock /tmp/agentkv-e2e.lock .venv/bin/pytest tests/e2e/test_pool_e2e.py
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest

import agentkv
from agentkv import CachePolicy, HandleState, Message
from agentkv.local._config import ClusterRecord, LocalClusterConfig
from agentkv.local._launch import start_cluster, stop_cluster
from agentkv.local._procs import pid_alive, stop_group

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("AGENTKV_POOL_E2E") != "1",
        reason="needs 3 extra vLLM servers; set AGENTKV_POOL_E2E=1 (see the module docstring)",
    ),
]

SYSTEM = "You are a warehouse assistant. Answer in one short sentence.\n" + "\n".join(
    f"Shelf {i}: holds parcel {i * 37 % 101} for customer {chr(65 + i % 26)}{i}." for i in range(30)
)
QUESTIONS = (
    "Which parcel is on shelf 3?",
    "Who is on shelf 7?",
    "Which shelf holds parcel 74?",
    "And who is on shelf 12?",
)


def _progress(message: str) -> None:
    sys.stderr.write(f"[e2e pool] {message}\n")


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalClusterConfig, ClusterRecord]]:
    config = LocalClusterConfig(
        prefill=2,
        decode=1,
        cluster_file=tmp_path_factory.mktemp("pool") / "cluster.json",
        base_port=19100,
        base_side_channel_port=17100,
    )
    record = start_cluster(config, progress=_progress)
    try:
        yield config, record
    finally:
        stop_cluster(config, progress=_progress)


def test_turns_spread_over_both_prefills_at_the_ideal_and_a_killed_prefill_costs_no_reuse(
    pool: tuple[LocalClusterConfig, ClusterRecord],
) -> None:
    config, record = pool
    pids = {name: server.pid for name, _, server in record.servers}
    salt = {"cache_salt": f"akv-pool-{uuid.uuid4().hex}"}  # nothing cached for anyone else
    with (
        agentkv.Cluster.from_file(config.cluster_file) as cluster,
        cluster.session(max_tokens=24, policy=CachePolicy(), extra_body=salt) as s,
    ):
        s.append(Message.system(SYSTEM))
        results = [s.send(QUESTIONS[0]), s.send(QUESTIONS[1])]
        warm = results[-1].stats.prefill
        assert results[0].stats.prefill == warm  # an idle pool keeps the warm prefill
        stop_group(pids[warm])
        assert not pid_alive(pids[warm])
        results += [s.send(QUESTIONS[2]), s.send(QUESTIONS[3])]
        roles = [m.role for m in s.transcript.messages]
    assert {r.stats.pair for r in results} == {"decode-0"}
    assert {r.stats.prefill for r in results} == {"prefill-0", "prefill-1"}
    for result in results[1:]:
        stats = result.stats
        assert stats.handle_state is HandleState.ATTACHED, stats
        assert stats.reused_tokens == stats.ideal_reused_tokens, stats
        assert stats.retries == 0, stats
    moved = results[2].stats
    assert moved.prefill != warm
    assert moved.pulled_tokens == moved.reused_tokens  # all of it from decode, none recomputed
    assert roles == ["system", *["user", "assistant"] * 4]
