"""The token-exact, append-only transcript of a session.

A decode node's turn-end KV covers exactly the previous prompt plus the generated tokens. vLLM's
pull is positional and unchecked, so the next prompt must start with exactly those tokens: the
transcript keeps them (``token_ids``), and only ever extends them with the template's closing of
the last assistant message and the tokens of newly appended messages. Each committed message
knows the span of tokens it occupies, so a later caller can line echoed messages up with tokens.

>>> t = Transcript()
>>> t.append(Message.user("hi"))
>>> prompt = t.prompt_for_turn(Delta(token_ids=(1, 2, 3), offsets=(0,), generation_start=2))
>>> t.commit_turn(prompt, generated_ids=(7, 9), message=Message.assistant("yo"),
...               finish_reason="stop")
>>> t.token_ids, [s.end for s in t.spans]
((1, 2, 3, 7, 9), [2, 5])
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field, replace
from types import MappingProxyType

from agentkv._exceptions import InvalidMessageError, PrefixDivergedError
from agentkv._prompt.history import HistoryPlan, plan_history
from agentkv._types import Message
from agentkv._wire.json import dumps

__all__ = ["TOKEN_TYPECODE", "Delta", "Span", "Transcript", "TranscriptView", "TurnPrompt"]

# Token ids are stored as C ints: 4 bytes a token instead of ~36 for a list of Python ints, which is
# most of an idle session's memory.
TOKEN_TYPECODE = "i"  # noqa: S105 - an array typecode (C int: 4 bytes), not a secret


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens ``[start, end)`` of the transcript that render one message.

    Messages the template renders as one unit (it changed the earlier one's tokens when the next
    was added) share the span of that unit.
    """

    start: int
    end: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Delta:
    """The rendered tokens of newly appended messages (or of the whole first prompt).

    ``offsets`` holds each message's start within ``token_ids``; ``generation_start`` is where the
    assistant header (the template's generation prompt) begins.
    """

    token_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    generation_start: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnPrompt:
    """A prompt built from a transcript, to be committed (or dropped) once the turn ends."""

    token_ids: array[int]
    base_version: int
    base_len: int
    closing_len: int
    messages: tuple[Message, ...]
    spans: tuple[Span, ...]
    generation_start: int
    #: ``token_ids`` as JSON list items (``b"1,2,3"``), when the transcript had them at hand.
    ids_json: bytes | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def tolist(self) -> list[int]:
        return self.token_ids.tolist()

    def json_ids(self) -> bytes:
        """``token_ids`` as a JSON list: ``json.dumps(self.tolist())``, compact."""
        if self.ids_json is None:
            return dumps(self.token_ids.tolist())
        return b"[" + self.ids_json + b"]"


def _items(ids: Sequence[int]) -> bytes:
    """``ids`` as JSON list items, without the brackets."""
    return dumps(ids if isinstance(ids, list) else list(ids))[1:-1]


def _joined(*parts: bytes) -> bytes:
    return b",".join(part for part in parts if part)


# No slots: a frozen dataclass with slots raises TypeError, not FrozenInstanceError, on setting a
# property (``token_ids``) under Python 3.11.
@dataclass(frozen=True, kw_only=True, eq=False)
class TranscriptView:
    """A read-only snapshot of a transcript (``session.transcript``).

    Taking one is cheap: the token ids become Python ints only when ``token_ids`` is read
    (``num_tokens`` counts them without that), so a caller that looks at the messages only (the
    proxy, on every request) never pays for a long conversation's tokens.
    """

    messages: tuple[Message, ...]
    spans: tuple[Span, ...]
    pending: tuple[Message, ...]
    #: Indices of the messages the model generated (the caller appended the others).
    generated: frozenset[int] = frozenset()
    #: What a client was shown for a generated message, where that differs.
    views: Mapping[int, Message] = field(default_factory=lambda: MappingProxyType({}))
    # Shared with the transcript, which never changes an array it has published.
    tokens: InitVar[array[int]]
    _tokens: array[int] = field(init=False, repr=False)
    _ids: tuple[int, ...] | None = field(init=False, default=None, repr=False)

    def __post_init__(self, tokens: array[int]) -> None:
        object.__setattr__(self, "_tokens", tokens)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The exact token ids of the committed messages (made on first read)."""
        if self._ids is None:
            object.__setattr__(self, "_ids", tuple(self._tokens))
        assert self._ids is not None
        return self._ids

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TranscriptView):
            return NotImplemented
        return (
            self.messages == other.messages
            and self.spans == other.spans
            and self.pending == other.pending
            and self._tokens == other._tokens
            and self.generated == other.generated
            and self.views == other.views
        )

    __hash__ = None  # type: ignore[assignment]  # a snapshot compared by value, not a key

    def __repr__(self) -> str:
        return (
            f"TranscriptView(messages={self.messages!r}, num_tokens={self.num_tokens}, "
            f"spans={self.spans!r}, pending={self.pending!r})"
        )


class Transcript:
    """Committed messages and their exact token ids, plus messages appended but not yet sent.

    Every method either succeeds or raises with the transcript unchanged.
    """

    __slots__ = (
        "_finish_reason",
        "_generated",
        "_json",
        "_messages",
        "_pending",
        "_spans",
        "_tail_open",
        "_token_tuple",
        "_tokens",
        "_version",
        "_views",
    )

    def __init__(self, messages: Iterable[Message] = ()) -> None:
        # Replaced, never changed in place once built: views share it (``view``).
        self._tokens: array[int] = array(TOKEN_TYPECODE)
        # ``token_ids`` as a tuple, made once per length: the tokens only ever grow (a commit
        # checks that the new ids extend them), so one length is one content.
        self._token_tuple: tuple[int, ...] = ()
        # ``_tokens`` as JSON list items, for the array it was made from: every turn sends the
        # whole prompt's ids, and serializing only what a turn adds saves ~30 us at 2k tokens.
        self._json: tuple[array[int], bytes] | None = None
        self._messages: list[Message] = []
        self._spans: list[Span] = []
        self._pending: list[Message] = []
        # True while the last committed message is a generated assistant message whose template
        # closing (e.g. ChatML's "<|im_end|>\n", minus what the model generated) is not yet added.
        self._tail_open = False
        self._finish_reason: str | None = None
        self._version = 0
        # Indices of the messages the model generated (the others were appended by the caller),
        # and what a caller's client was shown for one where that differs: echoes of them are
        # matched by meaning (``_prompt.history``).
        self._generated: set[int] = set()
        self._views: dict[int, Message] = {}
        self.append(*messages)

    # --- reading -------------------------------------------------------------------------------

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    @property
    def pending(self) -> tuple[Message, ...]:
        return tuple(self._pending)

    @property
    def token_ids(self) -> tuple[int, ...]:
        if len(self._token_tuple) != len(self._tokens):
            self._token_tuple = tuple(self._tokens)
        return self._token_tuple

    def token_array(self) -> array[int]:
        """A copy of the token ids as an ``array`` of ``TOKEN_TYPECODE``: one memory copy."""
        return array(TOKEN_TYPECODE, self._tokens)

    @property
    def spans(self) -> tuple[Span, ...]:
        return tuple(self._spans)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def version(self) -> int:
        """How many turns were committed; a prompt is valid only for the version it was built on."""
        return self._version

    @property
    def is_fresh(self) -> bool:
        """True before the first committed turn: the next prompt is a full render."""
        return not self._tokens

    @property
    def last_message(self) -> Message | None:
        return self._messages[-1] if self._messages else None

    @property
    def tail_open(self) -> bool:
        """True while the last generated assistant message still lacks its template closing."""
        return self._tail_open

    @property
    def generated(self) -> frozenset[int]:
        """Indices of the messages the model generated; the caller appended the others."""
        return frozenset(self._generated)

    @property
    def views(self) -> Mapping[int, Message]:
        """What a caller's client was shown for a generated message, where that differs."""
        return MappingProxyType(self._views)

    @property
    def finish_reason(self) -> str | None:
        """Why the last committed generation stopped (decides the closing it gets)."""
        return self._finish_reason

    def view(self) -> TranscriptView:
        return TranscriptView(
            messages=self.messages,
            tokens=self._tokens,
            spans=self.spans,
            pending=self.pending,
            generated=self.generated,
            views=MappingProxyType(dict(self._views)),
        )

    @classmethod
    def restore(
        cls,
        *,
        messages: Sequence[Message],
        token_ids: Sequence[int],
        spans: Sequence[Span],
        pending: Sequence[Message],
        tail_open: bool,
        finish_reason: str | None,
        version: int,
        generated: Iterable[int] = (),
        views: Mapping[int, Message] | None = None,
    ) -> Transcript:
        """Rebuild a saved transcript (``_client.save_file``); ``ValueError`` if inconsistent."""
        if len(spans) != len(messages):
            raise ValueError("a saved transcript needs one span per message")
        start = 0
        for span in spans:
            if not start <= span.start <= span.end <= len(token_ids):
                raise ValueError(f"span {span} does not fit the saved tokens")
            start = span.start
        if version < 0:
            raise ValueError("a saved transcript's version must not be negative")
        transcript = cls()
        transcript._tokens = array(TOKEN_TYPECODE, token_ids)
        transcript._messages = list(messages)
        transcript._spans = list(spans)
        transcript.append(*pending)
        transcript._tail_open = tail_open
        transcript._finish_reason = finish_reason
        transcript._version = version
        transcript.mark_generated(generated, views=views)
        return transcript

    # --- growing -------------------------------------------------------------------------------

    def append(self, *messages: Message) -> None:
        """Queue messages for the next turn."""
        for message in messages:
            if not isinstance(message, Message):
                raise InvalidMessageError(
                    f"expected a Message, got {type(message).__name__}; use Message.from_openai"
                )
        self._pending.extend(messages)

    def drop_pending(self, keep: int, *, count: int | None = None) -> None:
        """Forget pending messages after the first ``keep`` (undoes an append); only ``count`` of
        them when given (those appended later stay queued)."""
        del self._pending[keep : None if count is None else keep + count]

    def closing_suffix(self, closing: Sequence[int]) -> tuple[int, ...]:
        """The closing tokens still to add after the last generated assistant message.

        The model usually generated the first of them itself (ChatML's ``<|im_end|>``): only the
        rest is added. A generation cut by ``max_tokens`` gets the full closing.
        """
        if not self._tail_open:
            return ()
        if self._finish_reason == "length":
            return tuple(closing)
        tokens = self._tokens
        for overlap in range(min(len(closing), len(tokens)), 0, -1):
            if tokens[len(tokens) - overlap :].tolist() == list(closing[:overlap]):
                return tuple(closing[overlap:])
        return tuple(closing)

    def prompt_for_turn(
        self,
        delta: Delta,
        *,
        closing: Sequence[int] = (),
        messages: Sequence[Message] | None = None,
    ) -> TurnPrompt:
        """The next prompt: committed tokens + closing suffix + the pending messages' delta.

        ``messages`` are the pending messages ``delta`` renders (all of them by default): the
        first pending ones when more were appended while it was rendered; those stay queued for
        the turn after.
        """
        sent = tuple(self._pending) if messages is None else tuple(messages)
        if not sent:
            raise InvalidMessageError("nothing to send: append a message before the turn")
        if tuple(self._pending[: len(sent)]) != sent:
            raise PrefixDivergedError("the prompt renders messages that are no longer pending")
        if len(delta.offsets) != len(sent):
            raise ValueError("delta offsets must match the pending messages")
        suffix = self.closing_suffix(closing)
        base = len(self._tokens) + len(suffix)
        ids = array(TOKEN_TYPECODE, self._tokens)
        ids.extend(suffix)
        ids.extend(delta.token_ids)
        ids_json = _joined(self._tokens_json(), _items(suffix), _items(delta.token_ids))
        ends = [*delta.offsets[1:], delta.generation_start]
        spans = [
            Span(base + start, base + max(start, end))
            for start, end in zip(delta.offsets, ends, strict=True)
        ]
        # Messages the template could not split share the span of their unit.
        for i in range(len(spans) - 1, 0, -1):
            if delta.offsets[i] == delta.offsets[i - 1]:
                spans[i - 1] = spans[i] = Span(spans[i - 1].start, spans[i].end)
        return TurnPrompt(
            token_ids=ids,
            base_version=self._version,
            base_len=len(self._tokens),
            closing_len=len(suffix),
            messages=sent,
            spans=tuple(spans),
            generation_start=base + delta.generation_start,
            ids_json=ids_json,
        )

    def _tokens_json(self) -> bytes:
        tokens = self._tokens
        if self._json is None or self._json[0] is not tokens:
            self._json = (tokens, _items(tokens.tolist()))
        return self._json[1]

    def commit_turn(
        self,
        prompt: TurnPrompt,
        *,
        generated_ids: Sequence[int],
        message: Message,
        finish_reason: str,
    ) -> None:
        """Record a finished turn: its prompt, generated ids and assistant message.

        Raises ``PrefixDivergedError`` (and changes nothing) unless the prompt extends the committed
        tokens and was built on this transcript's current version.
        """
        if prompt.base_version != self._version:
            raise PrefixDivergedError(
                f"the prompt was built on transcript version {prompt.base_version}, "
                f"but the transcript is at version {self._version}"
            )
        n = len(self._tokens)
        if prompt.base_len != n or prompt.token_ids[:n] != self._tokens:
            raise PrefixDivergedError("the prompt does not start with the committed tokens")
        if tuple(self._pending[: len(prompt.messages)]) != prompt.messages:
            raise PrefixDivergedError("the prompt renders messages that are no longer pending")
        if message.role != "assistant":
            raise InvalidMessageError("a turn commits an assistant message")
        generated = array(TOKEN_TYPECODE, generated_ids)
        # Validation done: from here on nothing raises, so a commit is all or nothing.
        if self._tail_open and self._spans:
            last = self._spans[-1]
            self._spans[-1] = Span(last.start, last.end + prompt.closing_len)
        tokens = array(TOKEN_TYPECODE, prompt.token_ids)
        tokens.extend(generated)
        self._tokens = tokens
        if prompt.ids_json is not None:
            self._json = (tokens, _joined(prompt.ids_json, _items(generated.tolist())))
        self._messages.extend(prompt.messages)
        self._spans.extend(prompt.spans)
        self._messages.append(message)
        self._spans.append(Span(prompt.generation_start, len(self._tokens)))
        del self._pending[: len(prompt.messages)]
        self._generated.add(len(self._messages) - 1)
        self._tail_open = True
        self._finish_reason = finish_reason
        self._version += 1

    # --- branching -----------------------------------------------------------------------------

    def fork(
        self, *, keep: int | None = None, messages: Iterable[Message] | None = None
    ) -> Transcript:
        """A new transcript from the first ``keep`` committed messages, or from ``messages``.

        When the kept messages end with an assistant message at a clean token boundary, the new
        transcript keeps their exact tokens (so a prefill's local prefix cache still matches them);
        otherwise the kept messages are queued and the first turn renders them afresh. Pending
        messages are not carried over.
        """
        if (keep is None) == (messages is None):
            raise ValueError("fork takes exactly one of keep= or messages=")
        if messages is not None:
            return Transcript(messages)
        assert keep is not None
        if not 0 <= keep <= len(self._messages):
            raise ValueError(f"keep must be between 0 and {len(self._messages)}, got {keep}")
        kept = self._messages[:keep]
        if not kept or kept[-1].role != "assistant" or not self._clean_cut(keep):
            # Rendered afresh, a kept generated message is still the model's: its echoes match.
            child = Transcript(kept)
            child._keep_marks(self, keep)
            return child
        child = Transcript()
        child._keep_marks(self, keep)
        end = self._spans[keep - 1].end
        child._tokens = self._tokens[:end]
        child._messages = list(kept)
        child._spans = list(self._spans[:keep])
        if keep == len(self._messages):
            child._tail_open = self._tail_open
            child._finish_reason = self._finish_reason
        return child

    def _clean_cut(self, keep: int) -> bool:
        """True when message ``keep - 1`` ends where message ``keep`` starts (not one unit)."""
        return keep == len(self._spans) or self._spans[keep].start >= self._spans[keep - 1].end

    def _keep_marks(self, parent: Transcript, keep: int) -> None:
        self._generated = {i for i in parent._generated if i < keep}
        self._views = {i: view for i, view in parent._views.items() if i < keep}

    # --- histories -----------------------------------------------------------------------------

    def mark_generated(
        self, indices: Iterable[int] = (), *, views: Mapping[int, Message] | None = None
    ) -> None:
        """Record that messages ``indices`` (committed, then pending) were generated, and what
        a client was shown for some (``views``, generated too); ``ValueError`` out of range."""
        indices = set(indices)
        views = dict(views or {})
        count = len(self._messages) + len(self._pending)
        for index in indices | set(views):
            if not 0 <= index < count:
                raise ValueError(f"message {index} is not in a transcript of {count} messages")
        for view in views.values():
            if not isinstance(view, Message) or view.role != "assistant":
                raise InvalidMessageError("a generated message is shown as an assistant message")
        self._generated |= indices | set(views)
        self._views.update(views)

    def plan(self, incoming: Sequence[Message], *, tools_changed: bool = False) -> HistoryPlan:
        """How ``incoming`` (a whole conversation) maps onto the committed and pending messages
        (``_prompt.history.plan_history``); a fork's ``keep`` counts committed messages only."""
        held = [*self._messages, *self._pending]
        plan = plan_history(
            held,
            incoming,
            generated=self._generated,
            views=self._views,
            tools_changed=tools_changed,
        )
        committed = len(self._messages)
        if not plan.forked:
            return plan
        # Where the break falls in the session's tokens (a pending message has none yet).
        diverged = plan.diverged_message or 0
        token = self._spans[diverged].start if diverged < committed else len(self._tokens)
        plan = replace(plan, diverged_token=token, lost_tokens=len(self._tokens) - token)
        if plan.keep > committed:
            return replace(plan, keep=committed, new=tuple(incoming[committed:]))
        return plan
