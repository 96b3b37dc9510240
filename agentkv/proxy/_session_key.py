"""Which session a request belongs to, from the headers coding agents already send.

Agents name their conversations, each in its own header; an agent run unmodified against the
proxy keeps its KV when the proxy reads them. The first of these that a request carries is its
session id (``SESSION_SOURCES``, docs/proxy.md has the table):

1. ``X-Session-ID`` (agentkv's own; OpenCode sends it too, as ``x-session-id``);
2. ``X-Claude-Code-Session-Id`` (Claude Code 2.1.86+);
3. the id the body carries (``body_id``): chat's ``conversation_id`` / ``session_id``, the
   Messages API's ``metadata.user_id`` (``claude_code_session_id`` reads it);
4. Codex's ``session-id`` (0.131+), ``session_id`` (before), ``thread-id``,
   ``x-codex-window-id``;
5. OpenCode's ``x-session-affinity``, ``x-opencode-session``;
6. Dynamo's ``X-Dynamo-Session-ID``.

A session id can carry several threads of one agent (``SessionKey.agent_id``): Claude Code's
subagents send their parent's session id with ``x-claude-code-agent-id``, Codex's spawned
threads their own ``thread-id`` under the session's ``session-id``. A parent named apart
(``x-claude-code-parent-agent-id``, ``x-codex-parent-thread-id``, OpenCode's
``x-parent-session-id``, ``X-Dynamo-Parent-Session-ID``) is kept for the session JSON and for
placement: a child session goes on its parent's pair.

>>> key = session_key({"x-claude-code-session-id": "c1", "x-claude-code-agent-id": "a7"})
>>> key.session_id, key.agent_id, key.source
('c1', 'a7', 'x-claude-code-session-id')
>>> session_key({}, body_id=None) is None
True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from agentkv._core import loads
from agentkv.proxy._errors import ProxyError

__all__ = ["SESSION_SOURCES", "SessionKey", "claude_code_session_id", "session_key"]

MAX_ID = 256

# In precedence order; ``None`` is where the body's id goes.
SESSION_SOURCES: tuple[str | None, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    None,
    "session-id",
    "session_id",
    "thread-id",
    "x-codex-window-id",
    "x-session-affinity",
    "x-opencode-session",
    "x-dynamo-session-id",
)
_PARENTS = ("x-parent-session-id", "x-dynamo-parent-session-id")
_LEGACY_USER_ID = re.compile(r"^user_[0-9a-f]+_account_.*_session_([0-9A-Za-z-]+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionKey:
    """A request's session as its client named it.

    Attributes:
        session_id: the session id (the first source in ``SESSION_SOURCES``).
        source: where it came from: a header's name in lower case, or ``"body"``.
        agent_id: the thread within the session a subagent runs (``None``: the session's own).
        parent_id: the parent agent or session the client named, if any.
        parent_session: a parent *session* (OpenCode, Dynamo): the session is placed by it.
    """

    session_id: str
    source: str
    agent_id: str | None = None
    parent_id: str | None = None
    parent_session: str | None = None


def _checked(raw: str, name: str) -> str:
    value = raw.strip()
    if not value or len(value) > MAX_ID or not value.isprintable():
        raise ProxyError(
            400,
            f"{name} is 1 to {MAX_ID} printable characters",
            code="invalid_session_id",
            param=name,
        )
    return value


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    return None if value is None else _checked(value, name)


def _thread(headers: Mapping[str, str], source: str, session_id: str) -> tuple[str | None, ...]:
    """(agent id, parent id) of a thread within the session."""
    agent = _header(headers, "x-claude-code-agent-id")
    if agent is not None:
        return agent, _header(headers, "x-claude-code-parent-agent-id")
    if source in ("session-id", "session_id"):
        # Codex sends its thread id equal to the session id on the session's own thread.
        thread = _header(headers, "thread-id")
        if thread is not None and thread != session_id:
            return thread, _header(headers, "x-codex-parent-thread-id")
    return None, None


def session_key(headers: Mapping[str, str], body_id: str | None = None) -> SessionKey | None:
    """The request's session from ``headers`` (case-insensitive, as Starlette's) and the id its
    body carries (``body_id``); ``None`` when it names none. A malformed id is a 400."""
    for source in SESSION_SOURCES:
        raw = body_id if source is None else headers.get(source)
        if raw is None:
            continue
        name = source or "session id"
        session_id = _checked(raw, name)
        agent, parent = _thread(headers, source or "body", session_id)
        parent_session = next(
            (p for p in (_header(headers, h) for h in _PARENTS) if p is not None), None
        )
        return SessionKey(
            session_id=session_id,
            source=source or "body",
            agent_id=agent,
            parent_id=parent or parent_session,
            parent_session=parent_session if parent_session != session_id else None,
        )
    return None


def claude_code_session_id(user_id: object) -> str | None:
    """The session id in Claude Code's ``metadata.user_id``: a JSON string with ``session_id``
    (2.1.78+), before that ``user_<sha256>_account_<id>_session_<uuid>``; ``None`` otherwise.

    >>> claude_code_session_id('{"device_id": "d", "session_id": "5f0c"}')
    '5f0c'
    >>> claude_code_session_id("user_ab12_account_7_session_9e1d-4a")
    '9e1d-4a'
    """
    if not isinstance(user_id, str):
        return None
    if user_id.startswith("{"):
        try:
            parsed = loads(user_id)
        except ValueError:
            return None
        value = parsed.get("session_id") if isinstance(parsed, dict) else None
        return value if isinstance(value, str) and value else None
    match = _LEGACY_USER_ID.match(user_id)
    return match.group(1) if match else None
