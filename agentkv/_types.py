"""Values that cross module boundaries: messages, pairs, handles, turn settings, results, stats.

All are frozen, keyword-only dataclasses. Messages validate themselves on construction, so a bad
message fails where it is written, not three calls later inside a request:

>>> Message.user("What is the capital of France?").to_openai()
{'role': 'user', 'content': 'What is the capital of France?'}
>>> Message.from_openai({"role": "robot", "content": "hi"})
Traceback (most recent call last):
...
agentkv.InvalidMessageError: unknown role 'robot'; expected one of system, user, ...
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypedDict, cast

from agentkv import _constants as defaults
from agentkv._exceptions import ConfigError, InvalidMessageError
from agentkv._route import Route, TakenRoute
from agentkv._window import OversizedMaxTokens

__all__ = [
    "HandleState",
    "KVHandle",
    "Message",
    "MessageLike",
    "Pair",
    "Role",
    "SessionOptions",
    "SessionStats",
    "TextDelta",
    "ToolCall",
    "TurnOverrides",
    "TurnResult",
    "TurnStats",
]

Role: TypeAlias = Literal["system", "user", "assistant", "tool"]
_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
# Keys OpenAI clients echo back on assistant messages that carry nothing for the prompt when null.
_IGNORED_WHEN_EMPTY = frozenset(
    {"refusal", "annotations", "audio", "function_call", "reasoning_content", "reasoning"}
)
_KNOWN_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})


def _check_utf8(value: str | None, what: str) -> None:
    """Refuse text that cannot go on the wire (lone surrogates, e.g. from undecodable bytes)."""
    if value is None or value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(
            f"{what} is not valid Unicode text (position {exc.start}: {exc.reason}); decode "
            "bytes with errors='replace' before building a message"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """One function call the assistant asked for; ``arguments`` is the JSON text the model wrote.

    >>> ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}').to_openai()["type"]
    'function'
    """

    id: str
    name: str
    arguments: str = "{}"

    def __post_init__(self) -> None:
        if not isinstance(self.id, str):
            raise InvalidMessageError(
                f"tool call id must be a string, not {type(self.id).__name__}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise InvalidMessageError("tool call needs a non-empty function name")
        if not isinstance(self.arguments, str):
            raise InvalidMessageError(
                "tool call arguments must be JSON text (a string), "
                f"not {type(self.arguments).__name__}"
            )
        _check_utf8(self.arguments, "tool call arguments")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    @classmethod
    def from_openai(cls, data: object) -> ToolCall:
        """Parse an OpenAI ``tool_calls`` entry (``{"id", "type", "function": {...}}``)."""
        if not isinstance(data, Mapping):
            raise InvalidMessageError(f"a tool call must be an object, got {type(data).__name__}")
        function = data.get("function")
        if not isinstance(function, Mapping):
            raise InvalidMessageError("a tool call needs a 'function' object")
        return cls(
            id=data.get("id", ""),
            name=function.get("name", ""),
            arguments=function.get("arguments", "{}"),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One chat message. Build them with the role constructors or from OpenAI-style dicts.

    >>> Message.system("You are terse.").role
    'system'
    >>> Message.tool('{"temp": 21}', tool_call_id="call_1").tool_call_id
    'call_1'
    """

    role: Role
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise InvalidMessageError(
                f"unknown role {self.role!r}; expected one of {', '.join(_ROLES)}"
            )
        if self.content is not None and not isinstance(self.content, str):
            raise InvalidMessageError(
                f"{self.role} message content must be a string, got {type(self.content).__name__}"
            )
        if self.name is not None and not isinstance(self.name, str):
            raise InvalidMessageError("message name must be a string")
        _check_utf8(self.content, f"{self.role} message content")
        if not isinstance(self.tool_calls, tuple) or (
            self.tool_calls and not all(isinstance(call, ToolCall) for call in self.tool_calls)
        ):
            raise InvalidMessageError("tool_calls must be a tuple of ToolCall")
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise InvalidMessageError("an assistant message needs content or tool calls")
        elif not self.content:
            raise InvalidMessageError(f"{self.role} message content must be a non-empty string")
        if self.tool_calls and self.role != "assistant":
            raise InvalidMessageError("only assistant messages carry tool calls")
        if self.role == "tool":
            if not isinstance(self.tool_call_id, str) or not self.tool_call_id:
                raise InvalidMessageError("a tool message needs the tool_call_id it answers")
        elif self.tool_call_id is not None:
            raise InvalidMessageError("only tool messages carry a tool_call_id")

    @classmethod
    def system(cls, content: str, *, name: str | None = None) -> Message:
        return cls(role="system", content=content, name=name)

    @classmethod
    def user(cls, content: str, *, name: str | None = None) -> Message:
        return cls(role="user", content=content, name=name)

    @classmethod
    def assistant(
        cls, content: str | None = None, *, tool_calls: Iterable[ToolCall] = ()
    ) -> Message:
        return cls(role="assistant", content=content, tool_calls=tuple(tool_calls))

    @classmethod
    def tool(cls, content: str, *, tool_call_id: str, name: str | None = None) -> Message:
        return cls(role="tool", content=content, tool_call_id=tool_call_id, name=name)

    @classmethod
    def from_openai(cls, data: object) -> Message:
        """Parse an OpenAI chat message dict.

        Content given as a list of text parts is joined with newlines, as vLLM does for templates
        that take string content; any other part type is rejected.
        """
        if isinstance(data, Message):
            return data
        # A proxy parses every message of every re-sent history: plain dicts and lists (what
        # JSON gives) are checked by their exact type first, the ABCs only for other mappings.
        if type(data) is not dict and not isinstance(data, Mapping):
            raise InvalidMessageError(
                f"a message must be a dict or Message, not {type(data).__name__}"
            )
        if not _KNOWN_KEYS.issuperset(data.keys()):
            unknown = [
                key
                for key in data
                if key not in _KNOWN_KEYS and not (key in _IGNORED_WHEN_EMPTY and not data[key])
            ]
            if unknown:
                names = ", ".join(map(str, unknown))
                raise InvalidMessageError(f"unsupported message field(s): {names}")
        if "role" not in data:
            raise InvalidMessageError("a message needs a 'role'")
        raw_calls = data.get("tool_calls")
        calls: tuple[ToolCall, ...] = ()
        if raw_calls:
            if type(raw_calls) is not list and (
                not isinstance(raw_calls, Sequence) or isinstance(raw_calls, str)
            ):
                raise InvalidMessageError("tool_calls must be a list")
            calls = tuple(ToolCall.from_openai(call) for call in raw_calls)
        content = data.get("content")
        return cls(
            role=data["role"],
            content=content if type(content) is str else _content_text(content),
            tool_calls=calls,
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
        )

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat message dict (what vLLM's ``/tokenize`` and chat endpoints take)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _content_text(content: object) -> Any:
    """Join a list of text parts; anything else is returned for ``Message`` to validate."""
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise InvalidMessageError("only text content parts are supported")
            texts.append(cast(str, part["text"]))
        return "\n".join(texts)
    return content


MessageLike: TypeAlias = Message | Mapping[str, Any]


class HandleState(enum.StrEnum):
    """What happened to the stored decode handle on a turn (``TurnStats.handle_state``)."""

    ATTACHED = "attached"
    """Reused: sent with the P leg (prefill pulls the previous turn's KV from decode), or, on the
    ``decode`` route, its blocks served from decode's own prefix cache."""
    NONE = "none"
    """There was no handle (first turn, a fork, or decode returned none)."""
    EXPIRED = "expired"
    """The handle was past its deadline: decode may already have freed the blocks."""
    BELOW_THRESHOLD = "below_threshold"
    """Too few tokens to be worth a pull; prefill recomputes them."""
    CONSUMED = "consumed"
    """A failed attempt may have read (and so freed) the blocks; the retry ran without it."""
    INVALIDATED = "invalidated"
    """The session moved to another pair; the handle points at the old decode node."""
    DIVERGED = "diverged"
    """The handle covers tokens the prompt does not start with; sending it would load wrong KV."""
    UNUSED = "unused"
    """The handle was live, but the turn's route (``recompute``) did not use it: released."""
    TIER = "tier"
    """No live handle: the P leg carried the session's file-tier reference (an offloaded turn),
    and prefill loaded the matching prefix from the tier."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KVHandle:
    """The decode node's turn-end KV blocks, pinned for the next turn's prefill to pull.

    Single use: the decode node frees the blocks once a prefill has read them. ``deadline`` is on
    the session's clock (monotonic by default); ``server_expiry`` is the decode server's own
    ``time.perf_counter()`` deadline, which is not comparable with any local clock and is kept for
    logs only.

    ``lease_ttl_s`` is set when decode runs agentkv's extension and leased the pin to this
    session: the seconds it granted (after an extend, what was left then). Such a handle can be
    released and extended; ``extends`` counts the extensions. On stock vLLM it is ``None``.

    The fields are the handle; only ``agentkv._wire.handoff`` renders them as the next P leg's
    ``kv_transfer_params`` (``extra`` holds the engine's fields agentkv does not read).
    """

    pair: str
    engine_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    host: str
    port: int
    num_tokens: int
    issued_at: float
    deadline: float
    server_expiry: float | None = None
    lease_ttl_s: float | None = None
    extends: int = 0
    # The secret that, with request_id and block_ids, authorizes lease calls (None: not leased).
    lease: str | None = field(default=None, repr=False)
    # The engine's other kv_transfer_params (tp_size, ...): not interpreted, sent back verbatim.
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def remaining_s(self, now: float) -> float:
        """Seconds until ``deadline`` (negative once past)."""
        return self.deadline - now

    @property
    def leased(self) -> bool:
        """Decode leased the pin (agentkv's extension): it can be released and extended."""
        return self.lease_ttl_s is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnStats:
    """What one turn cost and reused.

    ``reused_tokens`` is prefill's own count (``usage.prompt_tokens_details.cached_tokens``): local
    prefix-cache hits plus tokens pulled from decode (or, on a ``tier`` turn, loaded from decode's
    file tier). ``pulled_tokens`` is the part that came from decode or its tier: exact when
    nothing was pulled, otherwise reused minus the prefill's local cache as estimated from the
    block size (a lower bound when the block size is unknown). ``ideal_reused_tokens`` is what a
    perfect handle gives: the previous turn's prompt and generated tokens, less the last
    generated one (its KV is never computed); on a ``tier`` turn, the tokens the tier holds.
    ``extends`` is how often the handle this turn started with was extended while the session
    waited (``session.tool_wait()``, ``session.extend_handle()``); ``handle_reason`` also says
    whether it survived a tool wait. ``prefill`` names the prefill server that ran the turn (in a
    pool it changes with load; ``pair`` is then the decode server the session is pinned to).

    ``route`` is how the prompt reached decode (``agentkv._route``), ``route_reason`` why:
    ``pull`` (prefill pulled the handle's KV back), ``recompute`` (the P leg carried none) or
    ``decode`` (no P leg: decode computed the new tokens itself, ``prefill`` is empty, and the
    reuse is decode's own count, its prefix cache holding the handle's blocks).

    Times: ``ttft_s`` runs from the call (``send``/``turn``/``stream``) to the first generated
    token, as a user waits for it: the prompt's rendering, lease calls and retries included.
    The server-side split: ``server_ttft_s`` from the last attempt's P leg to the first token,
    ``prefill_s`` the P leg, ``decode_s`` the D leg (to its last token), ``total_s`` the call.
    A non-streamed turn's first token arrives with its last.

    ``max_tokens`` is the output limit the turn ran with; ``max_tokens_clamped_from`` the
    caller's ask when it was above what the prompt left of the context and the turn clamped it
    (``agentkv._window``), else ``None``.
    """

    session_id: str
    turn: int
    pair: str
    prompt_tokens: int
    reused_tokens: int
    pulled_tokens: int
    computed_tokens: int
    generated_tokens: int
    ideal_reused_tokens: int
    ttft_s: float
    prefill_s: float
    server_ttft_s: float = 0.0
    decode_s: float
    total_s: float
    handle_state: HandleState
    handle_reason: str = ""
    retries: int = 0
    extends: int = 0
    prefill: str = ""
    route: TakenRoute = "pull"
    route_reason: str = ""
    max_tokens: int | None = None
    max_tokens_clamped_from: int | None = None

    @property
    def ttft_ms(self) -> float:
        return self.ttft_s * 1000.0

    @property
    def reuse_ratio(self) -> float | None:
        """``reused_tokens / ideal_reused_tokens``, or ``None`` when nothing could be reused."""
        return self.reused_tokens / self.ideal_reused_tokens if self.ideal_reused_tokens else None


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnResult:
    """The answer of one turn: the assistant message as committed to the transcript, and stats.

    ``token_ids`` are the generated ids exactly as decode produced them (the stop token included);
    ``result.text`` is the assistant's text. ``logprobs`` holds each generated token's logprob
    when the turn asked for them (``extra_body={"logprobs": True}``), else ``None``.
    ``stop_sequence`` is the stop string that ended the turn (vLLM's ``stop_reason``), else
    ``None``.
    """

    message: Message
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: TurnStats
    logprobs: tuple[float, ...] | None = None
    stop_sequence: str | None = None

    @property
    def text(self) -> str:
        """The assistant's text ('' when it only called tools)."""
        return self.message.content or ""

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return self.message.tool_calls


@dataclass(frozen=True, kw_only=True, slots=True)
class TextDelta:
    """A piece of assistant text, as ``session.stream()`` yields it before the ``TurnResult``.

    A stream's first delta also says what the turn did with the stored handle
    (``handle_state``, as the result's stats will), for a caller that answers before the turn
    ends (the proxy's response headers); later deltas carry ``None``. So does
    ``max_tokens_clamped_from``: the caller's ``max_tokens`` when the turn clamped it to what
    the context left (then ``max_tokens``, the limit it runs with; both ``None`` otherwise).
    """

    text: str
    handle_state: HandleState | None = None
    max_tokens: int | None = None
    max_tokens_clamped_from: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionStats:
    """Totals over a session's turns.

    ``reuse_ratio`` is reused over ideal summed over the turns that had something to reuse;
    ``median_warm_ttft_s`` is the median TTFT of turns 2 and later, the ones reuse speeds up.
    ``extends`` counts the extensions of handles made between turns (tool waits).
    """

    turns: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    ideal_reused_tokens: int = 0
    generated_tokens: int = 0
    retries: int = 0
    extends: int = 0
    reuse_ratio: float | None = None
    median_ttft_s: float | None = None
    median_warm_ttft_s: float | None = None

    @classmethod
    def from_turns(cls, turns: Sequence[TurnStats]) -> SessionStats:
        if not turns:
            return cls()
        with_ideal = [t for t in turns if t.ideal_reused_tokens]
        ideal = sum(t.ideal_reused_tokens for t in with_ideal)
        warm = [t.ttft_s for t in turns if t.turn >= 2]
        return cls(
            turns=len(turns),
            prompt_tokens=sum(t.prompt_tokens for t in turns),
            reused_tokens=sum(t.reused_tokens for t in turns),
            ideal_reused_tokens=sum(t.ideal_reused_tokens for t in turns),
            generated_tokens=sum(t.generated_tokens for t in turns),
            retries=sum(t.retries for t in turns),
            extends=sum(t.extends for t in turns),
            reuse_ratio=(sum(t.reused_tokens for t in with_ideal) / ideal) if ideal else None,
            median_ttft_s=statistics.median(t.ttft_s for t in turns),
            median_warm_ttft_s=statistics.median(warm) if warm else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Pair:
    """One prefill server and the decode server it hands off to.

    >>> Pair(name="p0", prefill="http://127.0.0.1:8100/", decode="http://127.0.0.1:8101").prefill
    'http://127.0.0.1:8100'
    """

    name: str
    prefill: str
    decode: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("a pair needs a non-empty name")
        for role in ("prefill", "decode"):
            url = getattr(self, role)
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(f"pair {self.name!r}: {role} must be an http(s) URL, got {url!r}")
            object.__setattr__(self, role, url.rstrip("/"))


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionOptions:
    """Per-turn request settings: session defaults, overridden field by field per turn."""

    max_tokens: int = defaults.MAX_TOKENS
    temperature: float | None = defaults.TEMPERATURE
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: Any = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    # How the prompt reaches decode (``agentkv._route``): "pull", "decode", "recompute", "auto".
    route: Route = "pull"
    # A ``max_tokens`` above what the prompt leaves of the context (``agentkv._window``):
    # "clamp" it to that, or "refuse" (``ContextLengthError``).
    oversized_max_tokens: OversizedMaxTokens = "clamp"


class TurnOverrides(TypedDict, total=False):
    """Per-turn overrides of the session's defaults (all optional)."""

    max_tokens: int
    temperature: float | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: Any
    extra_body: Mapping[str, Any]
    route: Route
    oversized_max_tokens: OversizedMaxTokens
