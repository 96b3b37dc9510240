"""One SDK cluster per (mode, salt group): a replayed conversation is one client process.

A Claude Code conversation runs its parent and subagents in one process, through one client: what
that client learns while serving one session (which prefill of a pool computed which prompt
prefix, the prefills' load) serves the others. The bench's lanes therefore share the SDK's
``AsyncCluster`` among the sessions of one salt group (``SessionScript.salt_group``) in one mode,
so a pool places a subagent's first turn on the prefill that computed its sibling's prompt
(``agentkv._placement.PrefixHomes``). Sessions without a group keep a cluster each, as before.
The shared clusters close with the run's lanes, after every session of the group has closed.
"""

from __future__ import annotations

from collections.abc import Callable

from agentkv import AsyncCluster
from agentkv.bench._config import Mode

__all__ = ["SharedClusters"]


class SharedClusters:
    """The clusters of a run's salt groups, made on first use and closed together."""

    def __init__(self) -> None:
        self._clusters: dict[tuple[Mode, str], AsyncCluster] = {}

    def get(self, mode: Mode, group: str, make: Callable[[], AsyncCluster]) -> AsyncCluster:
        """The group's cluster in ``mode``: ``make()``'s, the first time."""
        key = (mode, group)
        if key not in self._clusters:
            self._clusters[key] = make()
        return self._clusters[key]

    async def aclose(self) -> None:
        clusters, self._clusters = list(self._clusters.values()), {}
        for cluster in clusters:
            await cluster.aclose()
