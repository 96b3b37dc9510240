"""System blocks dropped before rendering: lines that differ per session or per request.

Claude Code's first system block is ``x-anthropic-billing-header: cc_version=2.1.328.<3 hex>;
cc_entrypoint=sdk-cli;`` (the suffix differs per session; subagents add ``cc_is_subagent=true;``,
other entrypoints a ``cch=`` nonce per request). It sits before ~12k tokens of system prompt and
tools that every session shares, so while it stays, no prefix-cache hit crosses sessions. vLLM's
own Messages server drops it too (``vllm/entrypoints/anthropic/serving.py``). The rules are
regular expressions searched in each system text block (a string ``system``, each text block of
a list, each ``role: "system"`` message of ``messages``); a block one matches is left out, and
the ``agentkv_proxy_system_blocks_dropped_total{rule}`` counter says so.

>>> rules = SystemDrops(DEFAULT_DROPS)
>>> rules.match("x-anthropic-billing-header: cc_version=2.1.328.a1f; cc_entrypoint=sdk-cli;")
'^x-anthropic-billing-header:'
>>> rules.match("You are Claude Code.") is None
True
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["DEFAULT_DROPS", "SystemDrops"]

DEFAULT_DROPS: tuple[str, ...] = (r"^x-anthropic-billing-header:",)


class SystemDrops:
    """Compiled drop rules; ``match`` names the first rule a block matches (its pattern)."""

    __slots__ = ("_rules",)

    def __init__(self, patterns: Sequence[str]) -> None:
        # Patterns are checked (``re.error``) where the configuration is built.
        self._rules = tuple((pattern, re.compile(pattern)) for pattern in patterns)

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(pattern for pattern, _ in self._rules)

    def match(self, text: str) -> str | None:
        for pattern, rule in self._rules:
            if rule.search(text):
                return pattern
        return None
