"""Collection of the examples in ``agentkv/`` (``--doctest-modules``, see ``pyproject.toml``).

Every module of the package is imported and its ``>>>`` examples run, except those below,
whose import does more than define names.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

collect_ignore = [
    # Imports vLLM (and torch) at module level: ~12 s and 5,000 modules in the test process,
    # Triton notices on stdout, and torch's DeprecationWarnings, which filterwarnings turns into
    # a collection error. It has no examples; the e2e tier loads it in the real servers.
    "agentkv/connector/_connector.py",
    # The same (vLLM's NIXL stats classes, subclassed there): no examples either.
    "agentkv/connector/_stats.py",
    # A sitecustomize runs at import: it re-runs the next sitecustomize on sys.path and, with
    # AGENTKV_CPU_ISA set, patches torch's CPU flags in this process.
    "agentkv/local/_isa/sitecustomize.py",
]


@pytest.fixture(autouse=True)
def _examples_print_no_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    """An example's output is what it prints, not agentkv's log events: those carry timestamps
    and ids, and whether debug events print at all depends on what configured structlog last."""
    if isinstance(request.node, pytest.Function):  # a test, not an example
        yield
        return
    with capture_logs():
        yield
