"""The cluster under test: a cluster file's pairs, or its pool of prefill and decode servers.

``agentkv up`` writes pairs as ``{"model", "pairs": [{"name", "prefill", "decode"}, ...]}`` and a
pool (``--prefill N --decode M``) as ``{"model", "prefill": [{"name", "url"}, ...], "decode":
[...]}``; the SDK reads both (``AsyncCluster.from_dict``), and the bench needs each role's
servers from either (decode's metrics, the limit's decode, the report's environment).

>>> spec = {"model": "m", "prefill": [{"name": "p0", "url": "http://p0"},
...                                   {"name": "p1", "url": "http://p1"}],
...         "decode": [{"name": "d0", "url": "http://d0"}]}
>>> target = ClusterTarget(spec=spec, transport=None)  # type: ignore[arg-type]
>>> target.pooled, target.urls("prefill"), target.servers("decode")
(True, ['http://p0', 'http://p1'], [('d0', 'http://d0')])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx2

from agentkv import ConfigError

__all__ = ["ClusterTarget", "check_spec"]

_ROLES = ("prefill", "decode")


def check_spec(spec: Any, *, where: str) -> dict[str, Any]:
    """``spec`` if it is a cluster file's shape (a model, and pairs or a pool), else a
    ``ConfigError`` naming ``where``."""
    pool = isinstance(spec, dict) and all(
        isinstance(spec.get(role), list) and spec[role] for role in _ROLES
    )
    if not isinstance(spec, dict) or not spec.get("model") or not (spec.get("pairs") or pool):
        raise ConfigError(f"cluster file {where} has no 'model' and 'pairs' (or a pool's "
                          "'prefill' and 'decode')")
    return spec


@dataclass(frozen=True, kw_only=True)
class ClusterTarget:
    """The cluster under test: its spec (cluster-file shape) and the transport that reaches it."""

    spec: Mapping[str, Any]
    transport: httpx2.AsyncBaseTransport

    @property
    def model(self) -> str:
        return str(self.spec["model"])

    @property
    def pooled(self) -> bool:
        """A pool of prefill and decode servers rather than pairs."""
        return "pairs" not in self.spec

    def servers(self, role: str) -> list[tuple[str, str]]:
        """``(name, url)`` of each ``role`` server ("prefill" or "decode"), in file order."""
        if self.pooled:
            return [(str(s.get("name")), str(s["url"])) for s in self.spec[role]]
        return [(str(p.get("name")), str(p[role])) for p in self.spec["pairs"]]

    def urls(self, role: str) -> list[str]:
        return [url for _, url in self.servers(role)]
