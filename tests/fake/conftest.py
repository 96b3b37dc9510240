"""Fixtures of the fake-pair tier: a manual clock, a fake cluster on it and an SDK cluster on that.

One definition of each, shaped per module or test by markers (registered in ``pyproject.toml``):

* ``fake``: a :class:`FakeCluster` of two pairs on ``clock``. ``@pytest.mark.fake(pairs=1, ...)``
  (usually a module's ``pytestmark``) passes options to ``FakeCluster``; a test's own mark wins
  over its module's, and an indirect parameter (``@pytest.mark.parametrize("fake", [{...}],
  indirect=True)``) over both. ``@pytest.mark.fake_variants(pytest.param({...}, id=...), ...)``
  runs each test that takes ``fake`` once per variant (unless it parametrizes ``fake`` itself).
  ``own_clock=True`` gives the fake a clock of its own, for modules whose ``clock`` drives
  something that must not expire handles (a proxy's idle sweep).
* ``module_fake``: the same, once per module, on a clock of its own: for module-scoped servers
  and hypothesis tests (which may not take function-scoped fixtures).
* ``transport``: how the SDK reaches ``fake`` (its transport); a module that injects faults or
  latency overrides it with a wrapper.
* ``cluster`` / ``acluster``: a :class:`Cluster` / :class:`AsyncCluster` on ``transport``, opened
  for the test and closed after it. ``@pytest.mark.cluster(...)`` passes options to
  ``from_dict`` (``block_size=16``, ``retry=...``); ``manual_clock=True`` runs the SDK on the
  test's ``clock`` too, so handle deadlines move only when the test advances it.

Find a session's servers by its pair's URLs (``fake.server(session.pair.decode)``), never by
parsing names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agentkv import AsyncCluster, Cluster
from agentkv.testing import FakeCluster, FakeTransport, ManualClock


def _options(node: pytest.Item | pytest.Collector, name: str) -> dict[str, Any]:
    """The keyword arguments of ``node``'s ``name`` marks, the closest mark winning."""
    options: dict[str, Any] = {}
    for mark in reversed(list(node.iter_markers(name))):
        options.update(mark.kwargs)
    return options


def _fake(options: dict[str, Any], clock: ManualClock) -> FakeCluster:
    options = {"pairs": 2, **options}
    if options.pop("own_clock", False):
        clock = ManualClock()
    return FakeCluster(clock=clock, **options)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``fake_variants``: each test that takes ``fake`` runs once per variant of its options."""
    variants = metafunc.definition.get_closest_marker("fake_variants")
    if variants is None or "fake" not in metafunc.fixturenames:
        return
    if any("fake" in mark.args[0] for mark in metafunc.definition.iter_markers("parametrize")):
        return  # the test chose its own
    metafunc.parametrize("fake", variants.args, indirect=True)


@pytest.fixture
def clock() -> ManualClock:
    """The clock of the test: handles, leases and TTLs move only when it is advanced."""
    return ManualClock()


@pytest.fixture
def fake(request: pytest.FixtureRequest, clock: ManualClock) -> FakeCluster:
    """Fake prefill/decode pairs on ``clock``, as the ``fake`` marks and parameter say."""
    return _fake({**_options(request.node, "fake"), **getattr(request, "param", {})}, clock)


@pytest.fixture(scope="module")
def module_fake(request: pytest.FixtureRequest) -> FakeCluster:
    """One fake for the module (its ``fake`` marks), on a clock of its own."""
    return _fake({**_options(request.node, "fake"), "own_clock": True}, ManualClock())


@pytest.fixture
def transport(fake: FakeCluster) -> FakeTransport:
    """The SDK's way to ``fake``: its transport, unless the module wraps it."""
    return fake.transport


def _cluster_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    options = _options(request.node, "cluster")
    if options.pop("manual_clock", False):
        options["clock"] = request.getfixturevalue("clock")
    return options


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, fake: FakeCluster, transport: Any
) -> Iterator[Cluster]:
    """A sync SDK cluster on ``fake`` (through ``transport``), as the ``cluster`` marks say."""
    with Cluster.from_dict(
        fake.cluster_spec, transport=transport, **_cluster_options(request)
    ) as opened:
        yield opened


@pytest.fixture
async def acluster(
    request: pytest.FixtureRequest, fake: FakeCluster, transport: Any
) -> AsyncIterator[AsyncCluster]:
    """An async SDK cluster on ``fake`` (through ``transport``), as the ``cluster`` marks say."""
    async with AsyncCluster.from_dict(
        fake.cluster_spec, transport=transport, **_cluster_options(request)
    ) as opened:
        yield opened
