"""Request fields the proxy does not use: the agents' known ones dropped quietly, the rest
warned about once per field name.

Coding agents send fields on every request that mean nothing to a self-hosted model (Codex's
``client_metadata`` on each Responses request, OpenAI clients' ``metadata``, ``user``,
``store``). vLLM ignores fields it does not know and says so; a warning on every request of an
agent's loop is noise that buries real ones, so the known fields go without a word (a debug
line) and an unknown field is warned about the first time it is seen (``IgnoredFields``).

>>> fields = IgnoredFields()
>>> fields.new_unknown(["client_metadata", "frobnicate"]), fields.new_unknown(["frobnicate"])
(['frobnicate'], [])
"""

from __future__ import annotations

from collections.abc import Iterable

from agentkv._core import get_logger

__all__ = ["QUIET_FIELDS", "IgnoredFields"]

logger = get_logger("agentkv")

QUIET_FIELDS = frozenset(
    {
        # Codex: its installation and window ids on every Responses request.
        "client_metadata",
        # OpenAI's own bookkeeping, sent by its SDKs and the agents built on them (OpenCode's
        # AI SDK provider, Codex): stored completions, end-user ids, tags, service tiers.
        "metadata",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "store",
        "user",
    }
)
"""Fields agents are known to send that the proxy drops without a warning."""

# Field names are the client's: a bound keeps a client that invents a new one per request from
# growing the set without end (past it, unknown fields are warned about every time again).
_MAX_WARNED = 1024


class IgnoredFields:
    """Which unknown fields were already warned about (one proxy app's)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def new_unknown(self, names: Iterable[str]) -> list[str]:
        """The unknown ones of ``names`` not warned about yet, now counted as warned."""
        fresh = [n for n in names if n not in QUIET_FIELDS and n not in self._warned]
        if len(self._warned) < _MAX_WARNED:
            self._warned.update(fresh)
        return fresh

    def report(self, names: Iterable[str]) -> None:
        """Log ``names``, ignored by a request: a warning for unknown ones new here, else a
        debug line."""
        names = sorted(names)
        if not names:
            return
        fresh = self.new_unknown(names)
        if fresh:
            logger.warning(
                "agentkv.proxy.fields_ignored",
                fields=fresh,
                detail="warned once per field; later requests that send it are not logged",
            )
        else:
            logger.debug("agentkv.proxy.fields_ignored", fields=names)
