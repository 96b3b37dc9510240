"""Chat completion bodies and SSE chunks, field for field as vLLM 0.32 serializes them.

Non-streaming bodies are ``ChatCompletionResponse.model_dump()`` (every field, ``null``
included); chunks are ``model_dump_json(exclude_unset=True)``; the usage chunk also drops
``null`` fields (``entrypoints/openai/chat_completion/serving.py``).

Streaming handles: stock vLLM puts no ``kv_transfer_params`` on a stream. With
``stream_handles`` the fake acts as a server with agentkv's plugin, which adds a top-level
``kv_transfer_params`` to the **last chunk before** ``data: [DONE]``: the usage chunk when
``stream_options.include_usage`` is set, the chunk carrying ``finish_reason`` otherwise.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from agentkv.testing._fake_protocol import ChatRequest
from agentkv.testing._fake_tokenizer import FakeTokenizer


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 16 hex characters."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def dumps(payload: Any) -> bytes:
    """Starlette's ``JSONResponse`` rendering."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True, kw_only=True)
class ChatOutput:
    response_id: str
    created: int
    model: str
    role: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    num_cache_creation_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # A stop string ended the output: the string, and the text as vLLM truncated it.
    stop_reason: str | None = None
    text: str | None = None
    # Characters a stream holds back while a stop string could still be completing.
    stop_buffer: int = 0


def _named_tool(request: ChatRequest) -> str | None:
    choice = request.tool_choice
    return str(choice["function"]["name"]) if isinstance(choice, dict) else None


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{random_uuid()}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _parse_required(text: str) -> list[dict[str, Any]]:
    """``TypeAdapter(list[FunctionDefinition]).validate_json``; invalid output means no calls."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
    ):
        return []
    return [
        _tool_call(c["name"], json.dumps(c.get("parameters"), ensure_ascii=False)) for c in calls
    ]


def _usage(output: ChatOutput) -> dict[str, Any]:
    n_prompt, n_out = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": {
            "cached_tokens": output.num_cached_tokens,
            "created_cache_tokens": output.num_cache_creation_tokens,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }


def chat_completion(
    request: ChatRequest, output: ChatOutput, tok: FakeTokenizer, *, tool_parser: bool
) -> dict[str, Any]:
    """The non-streaming body."""
    text = output.text
    if text is None:
        text = tok.decode(output.token_ids, skip_special_tokens=True)
    content: str | None = text
    tool_calls: list[dict[str, Any]] = []
    named = _named_tool(request)
    required = request.tool_choice == "required"
    if tool_parser and named is not None:
        tool_calls = [_tool_call(named, text)] if text.strip() else []
        content = ""
    elif tool_parser and required:
        tool_calls = _parse_required(text)
        content = ""
    message: dict[str, Any] = {
        "role": output.role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    message["reasoning"] = None
    finish = output.finish_reason
    if required and finish == "stop":
        finish = "tool_calls"
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": output.stop_reason,
        "token_ids": list(output.token_ids) if request.return_token_ids else None,
        "routed_experts": None,
    }
    return {
        "id": output.response_id,
        "object": "chat.completion",
        "created": output.created,
        "model": output.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(output),
        "prompt_logprobs": None,
        "prompt_token_ids": list(output.prompt_token_ids) if request.return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": output.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _utf8_deltas(tok: FakeTokenizer, ids: list[int]) -> list[str]:
    """Per-token text, holding back bytes of a character that is not complete yet."""
    pending = b""
    out: list[str] = []
    for token_id in ids:
        if not tok.is_special(token_id):
            pending += tok.piece(token_id)
        for cut in range(len(pending), max(-1, len(pending) - 4), -1):
            try:
                text = pending[:cut].decode()
            except UnicodeDecodeError:
                continue
            pending = pending[cut:]
            break
        else:
            text, pending = pending.decode(errors="replace"), b""
        out.append(text)
    return out


def _held_back(deltas: list[str], final: str | None, buffer: int) -> list[str]:
    """``get_next_output_text`` with a stop buffer: each delta holds back ``buffer`` characters
    (a stop string may be completing), the last one sends the rest of the final text."""
    full = "".join(deltas) if final is None else final
    out: list[str] = []
    sent = 0
    seen = 0
    last = len(deltas) - 1
    for i, delta in enumerate(deltas):
        seen += len(delta)
        upto = len(full) if i == last else min(seen - buffer, len(full))
        if upto > sent:
            out.append(full[sent:upto])
            sent = upto
        else:
            out.append("")
    return out


class _RequiredToolStream:
    """``extract_required_tool_call_streaming`` for the one call the fake model emits.

    The model writes ``[{"name": NAME, "parameters": ARGS}]`` (json.dumps spacing), possibly
    cut short by ``max_tokens``; a call streams once its name is closed and its arguments
    have started, then its argument text streams as it grows.
    """

    _PREFIX = '[{"name": '
    _ARGS_KEY = ', "parameters": '

    def __init__(self, text: str) -> None:
        self.name: str | None = None
        self.name_end = self.args_start = -1
        self.args_end: int | None = None
        decoder = json.JSONDecoder()
        if not text.startswith(self._PREFIX):
            return
        try:
            name, name_end = decoder.raw_decode(text, len(self._PREFIX))
        except json.JSONDecodeError:
            return
        if not text.startswith(self._ARGS_KEY, name_end):
            return
        self.name, self.name_end = str(name), name_end
        self.args_start = name_end + len(self._ARGS_KEY)
        try:
            self.args_end = decoder.raw_decode(text, self.args_start)[1]
        except json.JSONDecodeError:
            self.args_end = None

    def _ready_at(self, length: int) -> bool:
        return self.name is not None and self.name_end <= length and self.args_start < length

    def delta(self, text: str, sent: int, now: int) -> dict[str, Any] | None:
        if not self._ready_at(now):
            return None
        end = self.args_end if self.args_end is not None and self.args_end <= now else now
        if self._ready_at(sent):
            new = text[min(end, sent) : end]
            if not new:
                return None
            return {"index": 0, "function": {"name": None, "arguments": new}}
        return {
            "id": f"chatcmpl-tool-{random_uuid()}",
            "type": "function",
            "index": 0,
            "function": {"name": self.name, "arguments": text[self.args_start : end]},
        }


def _sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class _DeltaStream:
    """What vLLM's serving layer (and its tool parser, when configured) makes of each token."""

    def __init__(self, request: ChatRequest, text: str, *, tool_parser: bool) -> None:
        self._tool_parser = tool_parser
        self.named = _named_tool(request) if tool_parser else None
        required = tool_parser and request.tool_choice == "required"
        self._required = _RequiredToolStream(text) if required else None
        self._text = text
        self._sent = 0
        self.tools_streamed = False

    def next(self, delta_text: str) -> dict[str, Any] | None:
        sent, now = self._sent, self._sent + len(delta_text)
        self._sent = now
        delta: dict[str, Any] | None
        if self.named is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta_text}}
            if not self.tools_streamed:
                call = {
                    "id": f"chatcmpl-tool-{random_uuid()}",
                    "type": "function",
                    "index": 0,
                    "function": {"name": self.named, "arguments": delta_text},
                }
            delta = {"tool_calls": [call]}
        elif self._required is not None:
            required_call = self._required.delta(self._text, sent, now)
            delta = {"tool_calls": [required_call]} if required_call else None
        elif self._tool_parser:
            delta = {"content": delta_text} if delta_text else None
        else:
            delta = {"content": delta_text}
        if delta is not None and "tool_calls" in delta:
            self.tools_streamed = True
        return delta

    def finish_reason(self, reason: str) -> str:
        # "tool_calls" for auto/required calls, "stop" for a named tool (as OpenAI does).
        if self.tools_streamed and self.named is None and reason == "stop":
            return "tool_calls"
        return reason


def _role_chunk(
    request: ChatRequest, head: dict[str, Any], role: str, prompt_token_ids: list[int]
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        **head,
        "choices": [
            {
                "index": 0,
                "delta": {"role": role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    if request.continuous_usage:
        chunk["usage"] = _running_usage(len(prompt_token_ids), 0)
    chunk["prompt_token_ids"] = list(prompt_token_ids) if request.return_token_ids else None
    chunk["prompt_text"] = None
    return chunk


def _chunk_head(response_id: str, created: int, model: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
    }


def chat_completion_chunks(
    request: ChatRequest,
    output: ChatOutput,
    tok: FakeTokenizer,
    *,
    tool_parser: bool,
    stream_handles: bool,
) -> list[dict[str, Any]]:
    """The streamed chunks, in order, without the ``[DONE]`` line."""
    head = _chunk_head(output.response_id, output.created, output.model)
    chunks = [_role_chunk(request, head, output.role, output.prompt_token_ids)]
    deltas = _utf8_deltas(tok, output.token_ids)
    if output.text is not None or output.stop_buffer:
        deltas = _held_back(deltas, output.text, output.stop_buffer)
    stream = _DeltaStream(request, "".join(deltas), tool_parser=tool_parser)
    last = len(output.token_ids) - 1
    for i, (token_id, delta_text) in enumerate(zip(output.token_ids, deltas, strict=True)):
        delta = stream.next(delta_text)
        if delta is None and i != last and not request.return_token_ids:
            continue  # nothing to say for this token (e.g. inside tool-call syntax)
        choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None}
        choice["finish_reason"] = stream.finish_reason(output.finish_reason) if i == last else None
        if i == last:
            choice["stop_reason"] = output.stop_reason
        choice["token_ids"] = [token_id] if request.return_token_ids else None
        chunk: dict[str, Any] = {**head, "choices": [choice]}
        if request.continuous_usage:
            chunk["usage"] = _running_usage(len(output.prompt_token_ids), i + 1)
        chunks.append(chunk)
    if request.include_usage:
        usage = {k: v for k, v in _usage(output).items() if v is not None}
        usage["prompt_tokens_details"] = {
            k: v for k, v in usage["prompt_tokens_details"].items() if v is not None
        }
        chunks.append({**head, "choices": [], "usage": usage})
    if stream_handles and output.kv_transfer_params is not None:
        chunks[-1]["kv_transfer_params"] = output.kv_transfer_params
    return chunks


def _running_usage(n_prompt: int, n_out: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "completion_tokens_details": None,
    }


def encode_sse(chunks: list[dict[str, Any]], *, error: dict[str, Any] | None = None) -> bytes:
    """``data: {...}`` events, an optional error event, then ``data: [DONE]``."""
    lines = [_sse(c) for c in chunks]
    if error is not None:
        # create_streaming_error_response uses json.dumps' default separators.
        lines.append(f"data: {json.dumps(error)}\n\n")
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def error_stream_chunks(
    request: ChatRequest,
    *,
    response_id: str,
    created: int,
    model: str,
    role: str,
    prompt_token_ids: list[int],
) -> list[dict[str, Any]]:
    """What precedes an engine error in a stream: the role chunk only."""
    head = _chunk_head(response_id, created, model)
    return [_role_chunk(request, head, role, prompt_token_ids)]
