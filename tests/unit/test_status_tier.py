"""``agentkv status`` shows each server's file tier usage from ``GET /v1/agentkv/info``."""

from __future__ import annotations

import httpx2

from agentkv.cli import _tier_text, tier_usage
from agentkv.testing import FakeCluster


def test_status_reads_the_tier_usage_of_a_server_with_a_tier():
    fake = FakeCluster(pairs=1, tier=True, tier_budget_bytes=10**9)
    with httpx2.Client(transport=fake.transport) as client:
        usage = tier_usage(client, fake.decode(0).url)
    assert usage is not None
    assert (usage.bytes, usage.entries, usage.budget_bytes) == (0, 0, 10**9)
    assert _tier_text(usage.to_wire()) == "tier 0.0/1000 MB (0 entries)"


def test_status_shows_no_tier_for_servers_without_one_or_without_the_extension():
    for fake in (FakeCluster(pairs=1), FakeCluster(pairs=1, leases=False, stream_handles=False)):
        with httpx2.Client(transport=fake.transport) as client:
            assert tier_usage(client, fake.decode(0).url) is None
    assert _tier_text(None) == "tier -"


def test_status_survives_a_server_that_cannot_be_asked():
    fake = FakeCluster(pairs=1, tier=True)
    fake.decode(0).kill()
    with httpx2.Client(transport=fake.transport) as client:
        assert tier_usage(client, fake.decode(0).url) is None
