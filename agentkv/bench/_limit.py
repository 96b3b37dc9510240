"""The ``limit`` mode: each turn computes only its new tokens, and no KV moves between servers.

A turn of ``limit`` is one ordinary request to **one** server, the pair's decode server: no P leg,
no NIXL, no handle. Before each turn >= 2, off the clock, that server is sent the session's
committed tokens (the previous turn's prompt and output, exactly) as a one-token request under
the session's salt (:func:`fill_cache`), so its prefix cache holds every whole block of them. The
timed turn then sends the turn's exact prompt ids, built as the SDK modes build theirs (the SDK's
own ``Transcript`` and ``ChatTemplate``, rendered by that server's ``/tokenize``), so every mode's
prompts have the same tokens. Its TTFT runs, as the SDK's does, from the turn's start (rendering
the new message included) to the first generated token.

Why the decode server: at the end of a turn in P/D serving, that is where the session's KV is; a
turn served there without a hop is what the handle's pull approximates. Its first token also
comes out of the same server, API front end and stream path as the SDK modes' first tokens. On
the local pair both servers run the same model on one core each with prefix caching, and a
request whose ``kv_transfer_params`` holds nothing but ``prompt_token_ids`` (vLLM pops them: the
connector then sees no params) is served locally: nothing is pulled, and decode pins nothing.

What the limit assumes, and what it still computes: vLLM's prefix cache holds whole blocks only
(128 tokens on the CPU backend), so up to ``block_size - 1`` tokens of the previous turn are
recomputed with the new ones. ``reused_tokens`` is the server's own
``usage.prompt_tokens_details.cached_tokens``; ``prompt_tokens - reused_tokens`` is what was
computed, and the report's summary gives both its mean and the most old tokens any turn
recomputed. A pull from decode covers partial blocks, so agentkv can reuse slightly more than the
limit: agentkv / limit a little below 1 on a turn is that tail, not an error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx2

from agentkv import MalformedResponseError, Message
from agentkv._core import (
    ChatTemplate,
    HttpxPoster,
    ServerRenderer,
    Transcript,
    dumps,
    post_json,
    stream_events,
)
from agentkv.bench._config import Mode
from agentkv.bench._samples import Held, TurnSample
from agentkv.bench._workload import TurnScript

__all__ = ["LimitRunner", "fill_cache"]

_CHAT_PATH = "/v1/chat/completions"
# The answers echo the prompt's ids (``return_token_ids``); like the SDK, leave them unparsed.
_ECHO = "prompt_token_ids"
_PLACEHOLDER = ({"role": "user", "content": "."},)  # required by the route, never rendered


async def fill_cache(
    client: httpx2.AsyncClient, url: str, *, model: str, salt: str, token_ids: Sequence[int]
) -> None:
    """Prefill ``token_ids`` on the server at ``url`` under ``salt``, off the clock, so that its
    prefix cache holds every whole block of them; the one generated token is dropped.

    The ids go as ``kv_transfer_params.prompt_token_ids``, which vLLM's ``OnlineRenderer`` takes
    instead of the messages; without ``do_remote_decode`` the server hands nothing on and pins
    nothing (the oracle's fill on prefill, the limit's on decode).
    """
    body = {
        "model": model,
        "messages": list(_PLACEHOLDER),
        "max_tokens": 1,
        "stream": False,
        "cache_salt": salt,
        "kv_transfer_params": {"prompt_token_ids": list(token_ids)},
    }
    url = url.rstrip("/") + _CHAT_PATH
    await post_json(HttpxPoster(client), url, dumps(body), summary="cache fill", unread=_ECHO)


class _Answer:
    """The parts of a chat answer (streamed or not) the limit reads."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage: Mapping[str, Any] = {}

    def feed(self, chunk: Any, *, streamed: bool) -> bool:
        """Read one chunk (or the whole answer); true when it carried generated tokens."""
        if not isinstance(chunk, dict):
            return False
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        part = choice.get("delta" if streamed else "message") or {}
        content = part.get("content") if isinstance(part, dict) else None
        if isinstance(content, str):
            self.text.append(content)
        ids = choice.get("token_ids")
        if isinstance(ids, list) and set(map(type, ids)) <= {int}:
            self.token_ids.extend(ids)
        else:
            ids = None
        return bool(ids or content)

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cached if type(cached) is int else 0


class LimitRunner:
    """A session in ``limit`` mode: its turns on one server, its cache filled off the clock."""

    def __init__(
        self,
        *,
        index: int,
        client: httpx2.AsyncClient,
        url: str,
        model: str,
        system: str,
        salt: str,
        stream: bool,
    ) -> None:
        self._index = index
        self._client = client
        self._poster = HttpxPoster(client)
        self._url = url.rstrip("/")
        self._model = model
        self._salt = salt
        self._stream = stream
        # The SDK's prompt machinery, rendering with this server's template and tokenizer.
        self._template = ChatTemplate(ServerRenderer(self._poster, self._url, model=model))
        self._transcript = Transcript()
        self._system: str | None = system

    async def turn(self, script: TurnScript) -> TurnSample:
        transcript = self._transcript
        committed = transcript.num_tokens  # the previous turn's prompt and output
        if committed:
            await fill_cache(self._client, self._url, model=self._model, salt=self._salt,
                             token_ids=transcript.token_ids)
        if self._system is not None:
            transcript.append(Message.system(self._system))
            self._system = None
        transcript.append(Message.user(script.user))
        started = time.perf_counter()
        prompt = await self._template.prompt(transcript, transcript.pending)
        messages = [m.to_openai() for m in (*transcript.messages, *prompt.messages)]
        body: dict[str, Any] = {
            "model": self._model,
            "messages": messages,
            "max_tokens": script.output_tokens,
            "min_tokens": script.output_tokens,
            "temperature": 0.0,
            "stream": self._stream,
            "return_token_ids": True,
            "cache_salt": self._salt,
            # Nothing but the ids: no transfer flags, so the server serves the turn locally.
            "kv_transfer_params": {"prompt_token_ids": prompt.tolist()},
        }
        url = self._url + _CHAT_PATH
        answer = _Answer()
        first: float | None = None
        if self._stream:
            body["stream_options"] = {"include_usage": True}
            chunks = stream_events(self._poster, url, dumps(body), summary="limit turn",
                                   unread=_ECHO)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if answer.feed(chunk, streamed=True) and first is None:
                        first = time.perf_counter()
        else:
            data = await post_json(self._poster, url, dumps(body), summary="limit turn",
                                   unread=_ECHO)
            answer.feed(data, streamed=False)
        end = time.perf_counter()
        if answer.finish_reason is None or not answer.token_ids:
            raise MalformedResponseError(
                "unexpected limit answer", url=url,
                detail="no finish_reason or no token_ids (return_token_ids)",
            )
        transcript.commit_turn(
            prompt,
            generated_ids=answer.token_ids,
            message=Message.assistant("".join(answer.text)),
            finish_reason=answer.finish_reason,
        )
        prompt_len = len(prompt)
        return TurnSample(
            mode=Mode.LIMIT,
            session=self._index,
            turn=script.turn,
            ttft_s=(first if first is not None else end) - started,
            total_s=end - started,
            prompt_tokens=prompt_len,
            reused_tokens=min(answer.cached_tokens, prompt_len),
            # The same ideal as the SDK's: the previous prompt and output, less one.
            ideal_reused_tokens=min(max(0, committed - 1), prompt_len - 1),
            generated_tokens=len(answer.token_ids),
        )

    async def pause(self, expected_s: float) -> Held:
        return Held()  # the server's prefix cache keeps what it keeps; the next fill restores it

    async def aclose(self) -> None:
        await self._client.aclose()
