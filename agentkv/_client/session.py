"""Sessions: a conversation pinned to one prefill/decode pair, its KV threaded from turn to turn.

``AsyncSession`` does the I/O (``session_async``); ``Session`` is its sync twin, driving the same
core on the cluster's event-loop thread (``session_sync``). Both share ``SessionBase``
(``session_base``), which does none. This module gathers them.

>>> with cluster.session() as s:  # doctest: +SKIP
...     s.append(Message.system("You are terse."), Message.user("Capital of France?"))
...     print(s.turn().text)                 # "Paris."
...     print(s.send("And of Spain?").text)  # reuses turn 1's KV from the decode node
...     print(s.send("Thanks!", final=True).text)  # the last turn: decode pins nothing
...     print(s.stats.reuse_ratio)

With agentkv's vLLM extension on decode, a session also manages its pinned KV there: a final turn
pins nothing, ``tool_wait()`` keeps the handle alive through a long tool call, and closing the
session releases what is still pinned (see ``_leasing.py``).
"""

from __future__ import annotations

from agentkv._client.session_async import (
    AsyncSession,
    AsyncSessionHost,
    load_session,
    open_session,
    restore_session,
)
from agentkv._client.session_sync import Session, SessionHost
from agentkv._types import SessionOptions, TurnOverrides

__all__ = [
    "AsyncSession",
    "AsyncSessionHost",
    "Session",
    "SessionHost",
    "SessionOptions",
    "TurnOverrides",
    "load_session",
    "open_session",
    "restore_session",
]
