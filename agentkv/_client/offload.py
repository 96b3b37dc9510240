"""The session's ``offload=`` option: when a pin goes to decode's file tier.

``"auto"`` lets the policy decide (``CachePolicy.decide_tier``: a long wait, memory pressure),
``"never"`` keeps the pin in decode's memory, ``"always"`` offloads it (after the turn, or for a
tool wait) where decode has a tier. The option was called ``persist=`` with the values ``"pin"``
and ``"disk"``: those still work for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from typing import Literal, TypeAlias

from agentkv._policy import PersistMode

__all__ = ["OFFLOAD_MODES", "OffloadMode", "as_offload", "check_offload", "policy_hint"]

OffloadMode: TypeAlias = Literal["auto", "never", "always"]
OFFLOAD_MODES: tuple[OffloadMode, ...] = ("auto", "never", "always")
# The old values (``persist=``) and the policy's words for them.
_FROM_OLD: dict[str, OffloadMode] = {"pin": "never", "disk": "always", "auto": "auto"}
_TO_POLICY: dict[OffloadMode, PersistMode] = {"auto": "auto", "never": "pin", "always": "disk"}


def as_offload(mode: PersistMode | OffloadMode) -> OffloadMode:
    """``mode`` in today's words, without a warning (``X-AgentKV-Persist: disk | pin``)."""
    if mode == "pin":
        return "never"
    if mode == "disk":
        return "always"
    return mode


def check_offload(
    offload: object = "auto", persist: object | None = None, *, stacklevel: int = 3
) -> OffloadMode:
    """The session method's ``offload=`` (or its deprecated ``persist=``) checked: one of
    ``OFFLOAD_MODES``; the old keyword and the old values warn; anything else is a ValueError."""
    if persist is not None:
        warnings.warn(
            "persist= is deprecated: use offload= ('auto', 'never', 'always')",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        offload = persist
    if offload in ("pin", "disk"):
        if persist is None:
            warnings.warn(
                f"offload={offload!r} is deprecated: use {_FROM_OLD[str(offload)]!r}",
                DeprecationWarning,
                stacklevel=stacklevel,
            )
        return _FROM_OLD[str(offload)]
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    return offload


def policy_hint(mode: OffloadMode) -> PersistMode:
    """``mode`` in the words ``CachePolicy.decide_tier`` takes."""
    return _TO_POLICY[mode]
