"""A script that opens a cluster and sends turns prints nothing unless it asks for agentkv's events.

Each case runs in a fresh interpreter: logging's configuration is process-wide.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    import agentkv
    from agentkv.testing import FakeCluster

    setup = sys.argv[1]
    if setup == "configure_logging":
        agentkv.configure_logging()
    elif setup == "basicConfig":
        logging.basicConfig(level=logging.DEBUG)
    fake = FakeCluster(pairs=1)
    with agentkv.Cluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        with cluster.session() as s:
            for text in ("hi", "again"):
                s.append(agentkv.Message.user(text))
                s.turn()
    """
)
_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each case starts an interpreter (~2 s)


def _run(setup: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, setup],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=_ROOT,
    )


def test_an_unconfigured_script_prints_nothing() -> None:
    done = _run("none")
    assert (done.stdout, done.stderr) == ("", "")


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("configure_logging", "[info     ] agentkv.turn"),
        ("basicConfig", "DEBUG:agentkv:agentkv.leases_available decode="),
    ],
)
def test_one_call_shows_the_events_on_stderr(setup: str, expected: str) -> None:
    done = _run(setup)
    assert done.stdout == ""
    assert expected in done.stderr
    assert done.stderr.count("agentkv.turn") == 2
