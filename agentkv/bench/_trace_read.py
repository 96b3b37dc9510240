"""Reading traces: Mooncake-style JSONL, or kv-cache-tester conversations with their subagents.

A Mooncake line is one request (``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``); no session is named. A kv-cache-tester file is one conversation, ``{"id",
"block_size", "hash_id_scope", "requests": [...]}``, whose requests have ``t`` (seconds from the
conversation's start), ``in``, ``out``, ``hash_ids`` and ``think_time``; a subagent is an entry of
its parent's ``requests``, ``{"t", "type": "subagent", "agent_id", "subagent_type", "requests":
[...]}``, whose own requests' ``t`` count from the subagent's start. Both come out as one flat
list of ``TraceRequest`` in file order (a subagent's requests where its entry stands), times from
the conversation's start, each tagged with its conversation and agent.

With ``"hash_id_scope": "local"`` a conversation's ids mean nothing outside it (every file counts
from 1), subagents included: such requests carry their conversation as ``scope``, the namespace in
which the replay gives an id its text.

>>> conversation = {"id": "c", "block_size": 64, "hash_id_scope": "local", "requests": [
...     {"t": 0.0, "in": 100, "out": 5, "hash_ids": [1, 2]},
...     {"t": 9.5, "type": "subagent", "agent_id": "a1", "subagent_type": "Explore",
...      "requests": [{"t": 2.0, "in": 70, "out": 3, "hash_ids": [7, 8]}]}]}
>>> [(r.timestamp_s, r.agent, r.scope) for r in parse_trace(json.dumps(conversation),
...                                                         name="c.json").requests]
[(0.0, None, 'c'), (11.5, 'a1', 'c')]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv import ConfigError
from agentkv.bench._workload import Role

__all__ = [
    "CLAUDE_CODE_TRACE",
    "MOONCAKE_BLOCK_TOKENS",
    "SAMPLE_TRACE",
    "Role",
    "Trace",
    "TraceRequest",
    "load_trace",
    "parse_trace",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Mooncake's block size (its README): the default for traces that do not name one."""
SAMPLE_TRACE = Path(__file__).parent / "traces" / "mooncake_conversation_sample.jsonl"
"""The shipped Mooncake excerpt (``--trace sample``)."""
CLAUDE_CODE_TRACE = Path(__file__).parent / "traces" / "claude_code"
"""The shipped kv-cache-tester excerpt of Claude Code conversations with subagents
(``--trace claude-code``)."""

_SUBAGENT = "subagent"


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceRequest:
    """One recorded request, as the file gives it (times in seconds)."""

    index: int
    timestamp_s: float
    """From the trace's start (Mooncake) or the conversation's (kv-cache-tester, subagents
    included)."""
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    conversation: str | None = None
    """The session id of traces that name one (kv-cache-tester); ``None`` for Mooncake."""
    think_time_s: float | None = None
    """The recorded client delay before this request, when the trace has one."""
    agent: str | None = None
    """The subagent whose request this is (its ``agent_id``); ``None`` for the parent's."""
    subagent_type: str | None = None
    scope: str = ""
    """The namespace of the hash ids: the conversation when they are scoped to it, else ``""``
    (one namespace for the whole trace, as Mooncake's)."""

    @property
    def role(self) -> Role:
        return "parent" if self.agent is None else "subagent"


@dataclass(frozen=True, kw_only=True, slots=True)
class Trace:
    """A parsed trace: its requests in file order and its block size."""

    name: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    ignored_entries: int = 0
    """Entries that are neither requests nor subagents."""


def _int(entry: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = entry.get(name)
        if type(value) is int and value >= 0:
            return value
    wanted = " or ".join(names)
    raise ConfigError(f"trace entry has no non-negative integer {wanted}: {entry!r:.120}")


def _hash_ids(entry: Mapping[str, Any]) -> tuple[int, ...]:
    ids = entry.get("hash_ids")
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ConfigError(f"trace entry has no integer list hash_ids: {entry!r:.120}")
    return tuple(ids)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _mooncake(entry: Mapping[str, Any], index: int) -> TraceRequest:
    stamp = _number(entry.get("timestamp"))
    if stamp is None:
        raise ConfigError(f"trace entry has no numeric timestamp (ms): {entry!r:.120}")
    return TraceRequest(
        index=index,
        timestamp_s=stamp / 1000.0,
        input_tokens=_int(entry, "input_length"),
        output_tokens=_int(entry, "output_length"),
        hash_ids=_hash_ids(entry),
    )


@dataclass(kw_only=True, slots=True)
class _Reader:
    """Flattens one conversation's nested entries into ``out``."""

    conversation: str
    scope: str
    start: int
    out: list[TraceRequest]
    ignored: int = 0

    def entries(self, entries: Any, *, origin_s: float, agent: str | None,
                subagent_type: str | None) -> None:
        where = self.conversation if agent is None else f"{self.conversation}/{agent}"
        if not isinstance(entries, list):
            raise ConfigError(f"conversation {where!r} has no requests list")
        for entry in entries:
            if isinstance(entry, Mapping) and entry.get("type") == _SUBAGENT:
                self._subagent(entry, origin_s=origin_s, parent=agent)
            elif isinstance(entry, Mapping) and "hash_ids" in entry and "in" in entry:
                self._request(entry, origin_s=origin_s, agent=agent, subagent_type=subagent_type)
            else:
                self.ignored += 1  # markers and other non-request entries

    def _subagent(self, entry: Mapping[str, Any], *, origin_s: float, parent: str | None) -> None:
        agent = entry.get("agent_id")
        stamp = _number(entry.get("t"))
        kind = entry.get("subagent_type")
        if not isinstance(agent, str) or not agent:
            raise ConfigError(f"conversation {self.conversation!r}: a subagent has no agent_id")
        if stamp is None or stamp < 0:
            raise ConfigError(f"conversation {self.conversation!r}: subagent {agent!r} has no "
                              "non-negative numeric t")
        if kind is not None and not isinstance(kind, str):
            raise ConfigError(f"conversation {self.conversation!r}: subagent {agent!r} has a "
                              "non-string subagent_type")
        if not isinstance(entry.get("requests"), list):
            raise ConfigError(f"conversation {self.conversation!r}: subagent {agent!r} has no "
                              "requests list")
        # A subagent's subagent (none in the published traces) is its own agent too.
        name = agent if parent is None else f"{parent}/{agent}"
        self.entries(entry["requests"], origin_s=origin_s + stamp, agent=name,
                     subagent_type=kind)

    def _request(self, entry: Mapping[str, Any], *, origin_s: float, agent: str | None,
                 subagent_type: str | None) -> None:
        stamp = _number(entry.get("t"))
        if stamp is None:
            raise ConfigError(f"conversation {self.conversation!r}: a request has no numeric t")
        self.out.append(TraceRequest(
            index=self.start + len(self.out),
            timestamp_s=origin_s + stamp,
            input_tokens=_int(entry, "in"),
            output_tokens=_int(entry, "out"),
            hash_ids=_hash_ids(entry),
            conversation=self.conversation,
            think_time_s=_number(entry.get("think_time")),
            agent=agent,
            subagent_type=subagent_type,
            scope=self.scope,
        ))


def _conversation(
    data: Mapping[str, Any], start: int, fallback_id: str
) -> tuple[list[TraceRequest], int]:
    """A kv-cache-tester conversation's requests, its subagents' included, and how many entries
    were neither."""
    conversation = str(data.get("id", fallback_id))
    scope = conversation if data.get("hash_id_scope") == "local" else ""
    reader = _Reader(conversation=conversation, scope=scope, start=start, out=[])
    reader.entries(data.get("requests"), origin_s=0.0, agent=None, subagent_type=None)
    return reader.out, reader.ignored


def parse_trace(text: str, *, name: str, block_tokens: int | None = None) -> Trace:
    """Parse a trace: Mooncake JSONL (one request a line), or kv-cache-tester conversations (a
    JSON object with ``requests``, a list of them, or one a line)."""
    stripped = text.strip()
    documents: list[Any]
    try:
        try:
            documents = [json.loads(stripped)]  # one conversation, or a list of them
        except json.JSONDecodeError:
            documents = [json.loads(line) for line in stripped.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not JSON or JSONL: {exc}") from None
    if len(documents) == 1 and isinstance(documents[0], list):
        documents = documents[0]
    requests: list[TraceRequest] = []
    ignored = 0
    sizes: set[int] = set()
    for number, document in enumerate(documents):
        if not isinstance(document, Mapping):
            raise ConfigError(f"{name}: entry {number} is not a JSON object")
        if "requests" in document:
            size = document.get("block_size")
            if type(size) is int and size > 0:
                sizes.add(size)
            found, skipped = _conversation(document, len(requests), f"{name}#{number}")
            requests.extend(found)
            ignored += skipped
        else:
            requests.append(_mooncake(document, len(requests)))
    if len(sizes) > 1:
        raise ConfigError(f"{name}: conversations with different block sizes {sorted(sizes)}")
    size = block_tokens or (sizes.pop() if sizes else MOONCAKE_BLOCK_TOKENS)
    if not requests:
        raise ConfigError(f"{name}: no requests")
    return Trace(name=name, block_tokens=size, requests=tuple(requests), ignored_entries=ignored)


def load_trace(path: str | Path, *, block_tokens: int | None = None) -> Trace:
    """Read a trace file, or a directory of kv-cache-tester ``*.json`` conversations."""
    path = Path(path)
    try:
        if path.is_dir():
            files = sorted(path.glob("*.json"))
            text = "\n".join(json.dumps(json.loads(f.read_text())) for f in files)
        else:
            text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"no trace at {path}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"trace {path} is unreadable: {exc}") from exc
    return parse_trace(text, name=path.name, block_tokens=block_tokens)
