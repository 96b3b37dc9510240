"""Chat-template deltas: the tokens of newly appended messages, without re-rendering history.

Re-rendering a conversation rarely reproduces the tokens the model saw: templates re-render past
assistant turns differently (dropping reasoning, for example), and generated ids do not always
round-trip through text. So agentkv never re-renders history. For new messages it renders a small
fixed *anchor* conversation with and without them, checks that the first is a prefix of the
second, and takes the suffix::

    anchor           = [system "S", user "U", assistant "1"]
    render(anchor)               -> A
    render(anchor + new, gen=1)  -> A + delta          (delta = the new messages + assistant header)

When the new messages start with tool results, the anchor's assistant message is the real last one
(templates may look up its tool calls). The *closing* a template puts after an assistant message
(ChatML's ``<|im_end|>\\n``) is the common suffix of the anchor rendered with two different
assistant contents; it is added after the generated ids, minus what the model generated itself.

>>> import asyncio
>>> class Chars:  # a toy renderer: one token per character
...     async def render(self, messages, *, tools, add_generation_prompt):
...         text = "".join(f"<{m.role}>{m.content}." for m in messages)
...         return [ord(c) for c in text + ("<assistant>" if add_generation_prompt else "")]
>>> template = ChatTemplate(Chars())
>>> delta = asyncio.run(template.delta([Message.user("hi")], last=Message.assistant("x")))
>>> "".join(map(chr, delta.token_ids))
'<user>hi.<assistant>'
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentkv import _constants as defaults
from agentkv._exceptions import BadRequestError, MalformedResponseError, TemplateError
from agentkv._prompt.transcript import Delta, Transcript, TurnPrompt
from agentkv._types import Message
from agentkv._wire.http import post_json
from agentkv._wire.json import dumps, tools_key
from agentkv._wire.transport import Poster

__all__ = ["ChatTemplate", "Renderer", "ServerRenderer", "TemplateInfo", "tools_key"]

Tools = Sequence[Mapping[str, Any]] | None

_SYSTEM = Message.system("S")
_USER = Message.user("U")
_ASSISTANT_1 = Message.assistant("1")
_ASSISTANT_2 = Message.assistant("2")
_CACHE_LIMIT = defaults.TEMPLATE_CACHE_LIMIT


class Renderer(Protocol):
    """Renders messages to token ids with the model's chat template."""

    async def render(
        self, messages: Sequence[Message], *, tools: Tools, add_generation_prompt: bool
    ) -> list[int]: ...


class ServerRenderer:
    """A ``Renderer`` backed by a vLLM server's ``/tokenize`` endpoint (chat form).

    Uses the server's own template and tokenizer, so the tokens are those the server would
    produce; ``add_special_tokens`` is off because chat templates add their own. Every answer
    also says the server's context (``max_model_len``): kept, it costs no request of its own.
    """

    def __init__(self, client: Poster, base_url: str, *, model: str) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self.max_model_len: int | None = None

    @property
    def url(self) -> str:
        return self._url

    async def render(
        self, messages: Sequence[Message], *, tools: Tools, add_generation_prompt: bool
    ) -> list[int]:
        body: dict[str, Any] = {
            "model": self._model,
            "messages": [m.to_openai() for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "add_special_tokens": False,
        }
        if tools:
            body["tools"] = tools
        data = await post_json(self._client, self._url, dumps(body), summary="tokenize")
        length = data.get("max_model_len") if isinstance(data, dict) else None
        if type(length) is int and length > 0:
            self.max_model_len = length
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:
            raise MalformedResponseError(
                "unexpected tokenize answer", url=self._url, detail="no list of integer 'tokens'"
            )
        return tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class TemplateInfo:
    """The anchor renders of one template and tools list."""

    anchor: tuple[int, ...]
    """``render([S, U, assistant "1"])``: what every delta is measured from."""
    closing: tuple[int, ...]
    """What the template puts after an assistant message's content."""
    generation_prompt: tuple[int, ...]
    """The assistant header ``add_generation_prompt`` adds; empty if it depends on context."""


async def _ready(info: TemplateInfo) -> TemplateInfo:
    return info


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return tuple(a[len(a) - n :])


def _starts_with(seq: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(seq) >= len(prefix) and list(seq[: len(prefix)]) == list(prefix)


class ChatTemplate:
    """Computes prompt deltas through a ``Renderer``; caches the anchor renders per tools list.

    One instance serves every session on a server: concurrent first calls for a tools list share
    one set of anchor renders.
    """

    def __init__(self, renderer: Renderer) -> None:
        self._renderer = renderer
        self._info: dict[str, asyncio.Future[TemplateInfo]] = {}

    @property
    def max_model_len(self) -> int | None:
        """The server's context as its renders said it (``None``: not said, or not yet)."""
        length: int | None = getattr(self._renderer, "max_model_len", None)
        return length

    async def info(self, tools: Tools = None) -> TemplateInfo:
        key = tools_key(tools)
        future = self._info.get(key)
        if future is not None and future.done():
            return future.result()  # failures are never cached: a done one has its result
        if future is None:
            if len(self._info) >= _CACHE_LIMIT:
                self._info.pop(next(iter(self._info)))
            future = asyncio.get_running_loop().create_future()
            self._info[key] = future
            try:
                future.set_result(await self._compute_info(tools))
            except BaseException as exc:
                # Do not cache failures (a server restarting); waiters see this one.
                del self._info[key]
                future.set_exception(exc)
                future.exception()  # mark retrieved: the caller gets it re-raised below
                raise
        return await asyncio.shield(future)

    async def _compute_info(self, tools: Tools) -> TemplateInfo:
        render = self._renderer.render
        one, two, head, head_gen = await asyncio.gather(
            render([_SYSTEM, _USER, _ASSISTANT_1], tools=tools, add_generation_prompt=False),
            render([_SYSTEM, _USER, _ASSISTANT_2], tools=tools, add_generation_prompt=False),
            render([_SYSTEM, _USER], tools=tools, add_generation_prompt=False),
            render([_SYSTEM, _USER], tools=tools, add_generation_prompt=True),
        )
        closing = _common_suffix(one, two)
        if len(closing) >= min(len(one), len(two)):
            raise TemplateError("the template renders assistant contents '1' and '2' the same")
        generation_prompt = tuple(head_gen[len(head) :]) if _starts_with(head_gen, head) else ()
        return TemplateInfo(anchor=tuple(one), closing=closing, generation_prompt=generation_prompt)

    async def fingerprint(self) -> str:
        """A short digest of how this server tokenizes and templates a conversation.

        Token ids saved under one fingerprint mean nothing under another (a session file loaded
        into a cluster serving another tokenizer or template).
        """
        info = await self.info(None)
        text = json.dumps([info.anchor, info.closing, info.generation_prompt])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    async def closing(self, tools: Tools = None) -> tuple[int, ...]:
        return (await self.info(tools)).closing

    async def first(self, messages: Sequence[Message], *, tools: Tools = None) -> Delta:
        """The whole first prompt: a full render of ``messages`` plus the generation prompt."""
        return await self._render_delta((), messages, tools=tools, base=())

    async def delta(
        self, messages: Sequence[Message], *, last: Message, tools: Tools = None
    ) -> Delta:
        """The tokens ``messages`` add after a conversation whose last message is ``last``.

        ``last`` is an assistant message; its closing is not part of the delta (see
        ``Transcript.closing_suffix``).
        """
        if last.role != "assistant":
            raise TemplateError("deltas are computed after an assistant message")
        info = await self.info(tools)
        if messages and messages[0].role == "tool" and last.tool_calls:
            anchor: tuple[Message, ...] = (_SYSTEM, _USER, last)
            base = await self._renderer.render(anchor, tools=tools, add_generation_prompt=False)
        else:
            anchor, base = (_SYSTEM, _USER, _ASSISTANT_1), list(info.anchor)
        return await self._render_delta(anchor, messages, tools=tools, base=base, info=info)

    async def prompt(
        self, transcript: Transcript, pending: Sequence[Message], *, tools: Tools = None
    ) -> TurnPrompt:
        """The exact prompt of a turn that sends ``pending`` after ``transcript``'s committed
        messages: their token ids as they are, extended by the render of ``pending`` alone."""
        last = transcript.last_message
        if transcript.is_fresh or last is None:
            first = await self.first(pending, tools=tools)
            return transcript.prompt_for_turn(first, messages=pending)
        delta = await self.delta(pending, last=last, tools=tools)
        closing = await self.closing(tools)
        return transcript.prompt_for_turn(delta, closing=closing, messages=pending)

    async def _render_delta(
        self,
        anchor: Sequence[Message],
        messages: Sequence[Message],
        *,
        tools: Tools,
        base: Sequence[int],
        info: TemplateInfo | None = None,
    ) -> Delta:
        render = self._renderer.render
        convo = [*anchor, *messages]
        full_call = render(convo, tools=tools, add_generation_prompt=True)
        # Per-message boundaries need the conversation rendered up to each new message.
        partial_calls = [
            self._try_render([*anchor, *messages[:i]], tools=tools) for i in range(1, len(messages))
        ]
        partials: Sequence[list[int] | None]
        if info is not None and not partial_calls:
            # The common turn (one new message, anchors cached): one render, no tasks.
            full, partials, known = await full_call, [], info
        else:
            full, partials, known = await asyncio.gather(
                full_call,
                asyncio.gather(*partial_calls),
                self.info(tools) if info is None else _ready(info),
            )
        if not _starts_with(full, base):
            raise TemplateError(
                "the chat template is not append-stable here: rendering new "
                f"{'/'.join(m.role for m in messages)} message(s) changes the tokens of the "
                "conversation before them"
            )
        delta = full[len(base) :]
        offsets = [0]
        for partial in partials:
            end = self._boundary(partial, full, base, floor=offsets[-1])
            offsets.append(offsets[-1] if end is None else end)
        generation_start = await self._generation_start(
            convo, full=full, base=base, delta=delta, floor=offsets[-1], info=known, tools=tools
        )
        return Delta(
            token_ids=tuple(delta), offsets=tuple(offsets), generation_start=generation_start
        )

    async def _try_render(self, convo: Sequence[Message], *, tools: Tools) -> list[int] | None:
        # A partial conversation may be one the template refuses (roles must alternate, say):
        # that only costs the per-message split, not the turn.
        try:
            return await self._renderer.render(convo, tools=tools, add_generation_prompt=False)
        except (BadRequestError, TemplateError):
            return None

    @staticmethod
    def _boundary(
        partial: Sequence[int] | None, full: Sequence[int], base: Sequence[int], *, floor: int
    ) -> int | None:
        if partial is None or not _starts_with(full, partial):
            return None
        end = len(partial) - len(base)
        return end if end >= floor else None

    async def _generation_start(
        self,
        convo: Sequence[Message],
        *,
        full: Sequence[int],
        base: Sequence[int],
        delta: Sequence[int],
        floor: int,
        info: TemplateInfo,
        tools: Tools,
    ) -> int:
        """Where the assistant header starts in ``delta`` (its end if it cannot be told)."""
        header = info.generation_prompt
        start = len(delta) - len(header)
        if header and start >= floor and _starts_with(delta[start:], header):
            return start
        without = await self._try_render(convo, tools=tools)
        end = self._boundary(without, full, base, floor=floor)
        return len(delta) if end is None else end
