"""Saving a session to a JSON file and loading it back, so that an agent process can restart.

The file (``"format": "agentkv.session"``, ``"version": 4``) holds everything the next turn needs
to stay token-exact: the transcript's messages, token ids and spans, the pending messages, the
session id, pair, policy, options and turn stats, the model and a fingerprint of the tokenizer
and chat template the token ids come from, and the session's reusable KV as one tagged object
(``"kv"``: a pin's handle, a tier entry's reference, or why there is none; ``kv_json``, which
also reads the fields of versions 1-3).

Nothing in the file is trusted on its word. A handle's pin may have been released, consumed or
have expired since, and decode may have given its blocks to other requests: the first turn after
a load claims the lease from decode (``kv.confirm``) and attaches the handle only then; on stock
vLLM, which cannot confirm anything, a loaded handle is never attached. Prefill checks a tier
entry token by token, and one deleted, expired or evicted since is recomputed. Loading into a
cluster that serves another model is a ``SessionLoadError``; so is the first turn on a cluster
whose tokenizer or template differs from the saved fingerprint.

The file may hold a lease secret and a tier entry's secret: it is created readable by its owner
only. A save writes a temporary file in the same folder and renames it over the target, so a
crash in the middle of a save leaves the previous file (or none), never a half-written one.

>>> session.save("run.json")  # doctest: +SKIP
>>> session = Session.load("run.json", cluster)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agentkv._client import kv
from agentkv._client.kv_json import kv_from_json, kv_to_json
from agentkv._client.kv_json import saved_field as _field
from agentkv._client.kv_json import saved_optional as _optional
from agentkv._client.pool import PairPool
from agentkv._client.state import SessionState
from agentkv._client.turn_log import TurnLog
from agentkv._exceptions import AgentKVError, SessionLoadError
from agentkv._policy import CachePolicy
from agentkv._prompt.transcript import TOKEN_TYPECODE, Span, Transcript
from agentkv._route import check_route
from agentkv._types import Message, SessionOptions
from agentkv._window import check_oversized
from agentkv._wire.hints import HintError
from agentkv._wire.json import dumps, loads

__all__ = [
    "FORMAT",
    "VERSION",
    "load_state",
    "restore",
    "restore_bytes",
    "save_state",
    "snapshot",
    "snapshot_bytes",
    "write_atomic",
]

FORMAT = "agentkv.session"
# Version 4 saves the reusable KV as one tagged object (``kv_json``). Version 3 saves a handle's
# lease secret and its engine fields (``extra``) instead of the params decode sent
# (``params``); older files' params are read into both.
VERSION = 4
# Version 1 lacks the model and tokenizer fingerprint; it is read as if they matched.
_READABLE = (1, 2, 3, 4)
# snapshot_bytes: this, the JSON's length, the JSON, then the token ids.
_BINARY_MAGIC = b"agentkv.session.bin\x00"
_HEAD_LENGTH = struct.Struct(">I")


# --- saving --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _policy_items(policy: CachePolicy) -> tuple[tuple[str, Any], ...]:
    # A session's policy rarely changes, and a shared store snapshots it every turn.
    return tuple(dataclasses.asdict(policy).items())


def _policy_json(policy: CachePolicy) -> dict[str, Any]:
    saved = dict(_policy_items(policy))
    saved["tier_cost"] = dict(saved["tier_cost"])  # the caller's own copy, as the rest is
    saved["route"] = {**saved["route"], "cost": dict(saved["route"]["cost"])}
    return saved


def _options_json(options: SessionOptions) -> dict[str, Any]:
    return {
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "tools": [dict(tool) for tool in options.tools] if options.tools else None,
        "tool_choice": options.tool_choice,
        "extra_body": dict(options.extra_body),
        "route": options.route,
        "oversized_max_tokens": options.oversized_max_tokens,
    }


def snapshot(state: SessionState, *, model: str, now: float, wall: float) -> dict[str, Any]:
    """The session as a JSON-able dict; ``model`` is the one it runs on, ``now`` the session
    clock's time and ``wall`` the wall clock's."""
    token_ids = list(state.transcript.token_ids)
    return _snapshot(state, model=model, now=now, wall=wall, token_ids=token_ids)


def snapshot_bytes(state: SessionState, *, model: str, now: float, wall: float) -> bytes:
    """``snapshot``, compact: its JSON with the token ids after it as raw little-endian C ints
    (``TOKEN_TYPECODE``, 4 bytes on every platform agentkv runs on).

    A store of sessions shared by processes writes one after every turn and reads one before
    every turn that changes process: as JSON numbers the ids cost about 50 us per 1,000 tokens
    to write and read back (list, text, type check); as bytes, a copy.
    """
    tokens = state.transcript.token_array()
    if sys.byteorder != "little":
        tokens.byteswap()
    head = dumps(_snapshot(state, model=model, now=now, wall=wall, token_ids=len(tokens)))
    return b"".join((_BINARY_MAGIC, _HEAD_LENGTH.pack(len(head)), head, tokens.tobytes()))


def _snapshot(
    state: SessionState, *, model: str, now: float, wall: float, token_ids: list[int] | int
) -> dict[str, Any]:
    """The snapshot with ``token_ids`` as given: the list, or (``snapshot_bytes``) its length."""
    transcript = state.transcript
    return {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": wall,
        "session_id": state.session_id,
        "model": model,
        "tokenizer": state.fingerprint,
        "pair": state.pair.name,
        "policy": _policy_json(state.policy),
        "options": _options_json(state.options),
        "transcript": {
            "messages": [m.to_openai() for m in transcript.messages],
            "token_ids": token_ids,
            "spans": [[s.start, s.end] for s in transcript.spans],
            "pending": [m.to_openai() for m in transcript.pending],
            "tail_open": transcript.tail_open,
            "finish_reason": transcript.finish_reason,
            "version": transcript.version,
            "generated": sorted(transcript.generated),
            "views": {str(i): view.to_openai() for i, view in transcript.views.items()},
        },
        "kv": kv_to_json(state.kv, now=now, wall=wall),
        "turns": state.turns.saved(),
        "ideal_base": state.ideal_base,
        "prefilled": state.prefilled,
        "last_prefill": state.last_prefill,
        "tools_key": state.tools_key,
    }


def write_atomic(path: str | os.PathLike[str], chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` all or nothing: a temporary file, fsync, then a rename.

    If writing fails part way (a full disk, a crash, an exception from ``chunks``), ``path`` keeps
    its previous content and the temporary file is removed.
    """
    target = Path(path)
    # mkstemp creates the file readable by its owner only (the params may hold a lease secret).
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # Make the rename itself durable; not every filesystem lets a folder be fsynced.
    with contextlib.suppress(OSError):
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def save_state(
    state: SessionState,
    path: str | os.PathLike[str],
    *,
    model: str,
    now: float,
    wall_clock: Callable[[], float] = time.time,
) -> None:
    """Save ``state`` to ``path`` (see the module docstring and ``snapshot``)."""
    data = snapshot(state, model=model, now=now, wall=wall_clock())
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the session's options are not JSON-serializable: {exc}") from exc
    write_atomic(path, [text.encode()])


# --- loading -------------------------------------------------------------------------------------


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise SessionLoadError(f"no saved session at {os.fspath(path)}") from None
    except OSError as exc:
        raise SessionLoadError(f"saved session {os.fspath(path)} is unreadable: {exc}") from exc
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SessionLoadError(f"saved session {os.fspath(path)} is not JSON: {exc}") from exc
    return _checked(data, os.fspath(path))


def _checked(data: object, source: str) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SessionLoadError(f"{source} is not a saved agentkv session")
    if data.get("version") not in _READABLE:
        raise SessionLoadError(
            f"saved session {source} has schema version {data.get('version')!r}; "
            f"this agentkv reads versions {', '.join(map(str, _READABLE))}"
        )
    return data


def _transcript(data: Mapping[str, Any], tokens: array[int] | None = None) -> Transcript:
    spans = [Span(int(start), int(end)) for start, end in _field(data, "spans", list)]
    if tokens is not None:  # snapshot_bytes: integers by construction
        token_ids: Sequence[int] = tokens
    else:
        token_ids = _field(data, "token_ids", list)
        # set(map(type, ...)) runs in C: a shared proxy state loads a transcript on every turn.
        if not set(map(type, token_ids)) <= {int}:
            raise SessionLoadError("saved session: token_ids holds non-integers")
    return Transcript.restore(
        messages=[Message.from_openai(m) for m in _field(data, "messages", list)],
        token_ids=token_ids,
        spans=spans,
        pending=[Message.from_openai(m) for m in _field(data, "pending", list)],
        tail_open=_field(data, "tail_open", bool),
        finish_reason=_optional(data, "finish_reason", str),
        version=_field(data, "version", int),
        # Absent from older snapshots: no message is known to be generated.
        generated=[int(i) for i in data.get("generated", ())],
        views={int(i): Message.from_openai(v) for i, v in data.get("views", {}).items()},
    )


def _options(data: Mapping[str, Any]) -> SessionOptions:
    tools = _optional(data, "tools", list)
    return SessionOptions(
        max_tokens=_field(data, "max_tokens", int),
        temperature=_optional(data, "temperature", (int, float)),
        tools=tuple(tools) if tools else None,
        tool_choice=data.get("tool_choice"),
        extra_body=MappingProxyType(dict(_field(data, "extra_body", dict))),
        route=check_route(data.get("route", "pull")),  # saved before routes: pull
        oversized_max_tokens=check_oversized(data.get("oversized_max_tokens", "clamp")),
    )


def restore_bytes(
    blob: bytes,
    pool: PairPool,
    *,
    confirmed: bool = False,
    drop_handle: str | None = None,
    source: str = "saved session",
) -> SessionState:
    """A session from ``snapshot_bytes``' bytes, placed on ``pool`` as ``restore`` does."""
    if not blob.startswith(_BINARY_MAGIC):
        raise SessionLoadError(f"{source} is not a saved agentkv session")
    start = len(_BINARY_MAGIC) + _HEAD_LENGTH.size
    try:
        (length,) = _HEAD_LENGTH.unpack_from(blob, len(_BINARY_MAGIC))
        data = loads(blob[start : start + length])
        count = _field(_field(data, "transcript", dict), "token_ids", int)
    except (ValueError, struct.error, SessionLoadError) as exc:
        raise SessionLoadError(f"saved session {source} is corrupt: {exc}") from exc
    raw = blob[start + length :]
    tokens = array(TOKEN_TYPECODE)
    if len(raw) != tokens.itemsize * count:
        raise SessionLoadError(
            f"saved session {source} is corrupt: {len(raw)} bytes of token ids for {count} tokens"
        )
    tokens.frombytes(raw)
    if sys.byteorder != "little":
        tokens.byteswap()
    return restore(
        data, pool, confirmed=confirmed, drop_handle=drop_handle, source=source, tokens=tokens
    )


def load_state(
    path: str | os.PathLike[str],
    pool: PairPool,
    *,
    wall_clock: Callable[[], float] = time.time,
) -> SessionState:
    """Read a saved session and place it on ``pool``: its saved pair when that is known and
    healthy (the handle then stays usable), another pair otherwise (the handle is dropped).

    Raises ``SessionLoadError`` for a missing, corrupt or unknown-version file. Call it on the
    pool's event loop (it takes a place on a pair).
    """
    return restore(_read(path), pool, wall_clock=wall_clock, source=os.fspath(path))


def restore(
    data: object,
    pool: PairPool,
    *,
    wall_clock: Callable[[], float] = time.time,
    source: str = "saved session",
    confirmed: bool = False,
    drop_handle: str | None = None,
    tokens: array[int] | None = None,
) -> SessionState:
    """A session from ``snapshot``'s dict, placed on ``pool`` as ``load_state`` does.

    ``confirmed``: the caller knows the snapshot is the session's latest state and that nothing
    used its handle since it was taken (a shared store knows it from its claims), so the handle
    is attached as the session that took it would attach it, without asking decode first.
    ``drop_handle``: the caller knows another copy may be using the handle right now (its holder
    stopped mid-turn, and may only be slow): the handle is neither attached nor released, and
    the reason given is the next turn's ``handle_reason``. A claim cannot guard that case: a
    prefill's pull checks no lease, so the other copy's turn may read the blocks anyway.
    ``tokens``: the token ids, when ``data`` came from ``snapshot_bytes`` (``restore_bytes``).
    """
    data = _checked(data, source)
    now, wall = pool.clock(), wall_clock()
    try:
        session_id = _field(data, "session_id", str)
        saved_pair = _field(data, "pair", str)
        policy = CachePolicy(**_field(data, "policy", dict))
        options = _options(_field(data, "options", dict))
        transcript = _transcript(_field(data, "transcript", dict), tokens)
        saved_kv = kv_from_json(data, now=now, wall=wall)
        turns = TurnLog.restored(_field(data, "turns", list))
        ideal_base = _field(data, "ideal_base", int)
        prefilled = _field(data, "prefilled", int)
        last_prefill = _optional(data, "last_prefill", str)
        tools_key = _optional(data, "tools_key", str)
        model = _optional(data, "model", str)
        fingerprint = _optional(data, "tokenizer", str)
    except SessionLoadError:
        raise
    except (AgentKVError, HintError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise SessionLoadError(f"saved session {source} is corrupt: {exc}") from exc
    if model is not None and model != pool.model:
        raise SessionLoadError(
            f"saved session {source} ran on model {model!r}; this cluster serves "
            f"{pool.model!r}, whose tokens and KV are not the saved ones"
        )
    known = {pair.name: pair for pair in pool.pairs}
    pool.check_open()
    pair = pool.acquire(session_id, near=known.get(saved_pair))
    state = SessionState(
        session_id=session_id,
        pair=pair,
        policy=policy,
        options=options,
        transcript=transcript,
    )
    state.turns = turns
    state.ideal_base = ideal_base
    state.tools_key = tools_key
    state.apply(kv.Step(saved_kv))
    state.last_prefill = last_prefill
    # Checked against the cluster's tokenizer before the first turn's prompt is built.
    state.fingerprint = fingerprint
    if pair.name == saved_pair:
        state.prefilled = prefilled
    else:
        # A handle into another pair's decode is useless here; this copy releases nothing.
        state.move_to(pair, now=now)
    state.apply(kv.restored(state.kv, pair=pair.name, confirmed=confirmed, drop=drop_handle))
    return state
