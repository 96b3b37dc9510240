"""``POST /v1/chat/completions``: vLLM's checks in vLLM's order, then the engine, then the body.

Order of checks as in ``OpenAIServingChat._create_chat_completion`` and ``OnlineRenderer``:
model, tool parser, request chat template, ``max_tokens`` vs ``max_model_len``, forwarded
``prompt_token_ids`` (else template + tokenizer with its length checks), input length.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from agentkv.testing._fake_context import ServerContext
from agentkv.testing._fake_engine import EngineError, EngineRequest, FakeEngine
from agentkv.testing._fake_kv import KVCacheFullError
from agentkv.testing._fake_model import ToolSpec
from agentkv.testing._fake_protocol import (
    ApiError,
    ChatRequest,
    error_body,
    parse_chat_request,
    vllm_validation_error,
)
from agentkv.testing._fake_reply import Reply
from agentkv.testing._fake_responses import (
    ChatOutput,
    chat_completion,
    chat_completion_chunks,
    error_stream_chunks,
    random_uuid,
)
from agentkv.testing._fake_stop import stop_buffer_length

ENGINE_ERROR = error_body(
    "Internal server error", err_type="InternalServerError", code=500, param=None
)
_AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


def serve_chat(
    ctx: ServerContext, engine: FakeEngine, data: Any, headers: Mapping[str, str]
) -> Reply:
    """Answer a parsed JSON body (raises ``ApiError`` for 4xx answers)."""
    request = parse_chat_request(data)
    try:
        return _complete(ctx, engine, request, headers)
    except ApiError:
        # _with_kv_transfer_rejection_cleanup: a D leg rejected before reaching the engine
        # tells the prefill server to free the blocks it holds for it.
        engine.reject(request.kv_transfer_params)
        raise


def _complete(
    ctx: ServerContext, engine: FakeEngine, request: ChatRequest, headers: Mapping[str, str]
) -> Reply:
    ctx.check_model(request.model)
    _check_tool_parser(ctx, request)
    ctx.check_chat_template(request.chat_template, request.chat_template_kwargs)
    prompt = _prompt_ids(ctx, request)
    max_tokens = _max_tokens(ctx, request, len(prompt))
    base_id = headers.get("x-request-id") or request.request_id or random_uuid()
    response_id = f"chatcmpl-{base_id}"
    role = "assistant"
    if not request.add_generation_prompt and request.messages:
        role = str(request.messages[-1]["role"])
    engine_request = EngineRequest(
        # AsyncLLM makes the engine's request id unique with 8 random characters.
        request_id=f"{response_id}-{random_uuid()[:8]}",
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        tool=_tool_spec(ctx, request),
        kv_transfer_params=request.kv_transfer_params,
        cache_salt=request.cache_salt,
        stop=request.stop,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )
    created = int(time.time())
    try:
        result = engine.run(engine_request)
    except (EngineError, KVCacheFullError):
        if not request.stream:
            return Reply.error(500, ENGINE_ERROR)
        # The stream already started: a 200, the role chunk, then an error event.
        chunks = error_stream_chunks(
            request,
            response_id=response_id,
            created=created,
            model=ctx.model,
            role=role,
            prompt_token_ids=prompt,
        )
        return sse_reply(tuple(chunks), error=ENGINE_ERROR)
    output = ChatOutput(
        response_id=response_id,
        created=created,
        model=ctx.model,
        role=role,
        prompt_token_ids=prompt,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        num_cached_tokens=_reported_cached_tokens(request, result.num_cached_tokens),
        num_cache_creation_tokens=result.num_cache_creation_tokens,
        kv_transfer_params=result.kv_transfer_params,
        stop_reason=result.stop_reason,
        text=result.text,
        stop_buffer=stop_buffer_length(request.stop, include=request.include_stop_str_in_output),
    )
    parser = ctx.tool_call_parser is not None
    if request.stream:
        chunks = chat_completion_chunks(
            request, output, ctx.tokenizer, tool_parser=parser, stream_handles=ctx.stream_handles
        )
        return sse_reply(tuple(chunks))
    return Reply(json=chat_completion(request, output, ctx.tokenizer, tool_parser=parser))


def sse_reply(chunks: tuple[dict[str, Any], ...], *, error: dict[str, Any] | None = None) -> Reply:
    return Reply(chunks=chunks, stream_error=error, content_type="text/event-stream; charset=utf-8")


def _check_tool_parser(ctx: ServerContext, request: ChatRequest) -> None:
    """``OnlineRenderer.render_chat``: tool choices need server-side parser flags."""
    choice = request.tool_choice
    if choice == "none":
        return
    if choice == "auto":
        if ctx.tool_call_parser is None or not ctx.enable_auto_tool_choice:
            raise ApiError(_AUTO_NEEDS_FLAGS)
        return
    if ctx.tool_call_parser is None:
        desc = (
            f'function "{choice["function"]["name"]}"'
            if isinstance(choice, dict)
            else f'"{choice}"'
        )
        raise ApiError(f"tool_choice={desc} requires --tool-call-parser to be set")


def _max_tokens(ctx: ServerContext, request: ChatRequest, n_prompt: int) -> int:
    """``build_tok_params`` / ``get_max_tokens`` / ``SamplingParams`` checks."""
    limit = ctx.max_model_len
    if n_prompt > limit:
        # Forwarded ids skip the tokenizer's check; get_max_tokens raises a ValueError.
        raise ApiError(
            f"Input length ({n_prompt}) exceeds model's maximum context length ({limit})."
        )
    max_tokens = limit - n_prompt
    if request.max_tokens is not None:
        max_tokens = min(max_tokens, request.max_tokens)
    if max_tokens < 1:
        raise vllm_validation_error(
            f"max_tokens must be at least 1, got {max_tokens}.",
            parameter="max_tokens",
            value=max_tokens,
        )
    return max_tokens


def _prompt_ids(ctx: ServerContext, request: ChatRequest) -> list[int]:
    """Forwarded ``prompt_token_ids`` (skipping the template), else the rendered chat."""
    limit = ctx.max_model_len
    if request.max_tokens is not None and request.max_tokens > limit:
        raise vllm_validation_error(
            f"{request.max_tokens_param}={request.max_tokens} cannot be greater than "
            f"max_model_len={limit}. Please request fewer output tokens.",
            parameter=request.max_tokens_param,
            value=request.max_tokens,
        )
    ids = request.prompt_token_ids
    if ids is not None and not request.echo:
        return _forwarded_ids(ctx, ids)
    text = ctx.render(
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
    )
    max_chars = limit * ctx.tokenizer.max_chars_per_token
    if len(text) > max_chars:
        raise vllm_validation_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {len(text)} characters (more than {max_chars} characters, which is "
            f"the upper bound for {limit} input tokens). Please reduce the length of the "
            "input prompt.",
            parameter="input_text",
            value=len(text),
        )
    prompt = ctx.tokenizer.encode(text)
    if len(prompt) > limit:
        # The tokenizer stops at limit + 1 tokens, hence "at least".
        raise vllm_validation_error(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains at least {limit + 1} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            parameter="input_tokens",
            value=limit + 1,
        )
    return prompt


def _forwarded_ids(ctx: ServerContext, ids: Any) -> list[int]:
    """``_reused_prompt_token_ids`` in ``vllm/renderers/online_renderer.py``."""
    param = "kv_transfer_params.prompt_token_ids"
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise vllm_validation_error(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list "
            "of non-negative integers.",
            parameter=param,
        )
    if max(ids) >= ctx.tokenizer.vocab_size:
        raise vllm_validation_error(f"Token id {max(ids)} is out of vocabulary", parameter=param)
    return list(ids)


def _tool_spec(ctx: ServerContext, request: ChatRequest) -> ToolSpec | None:
    """What structured outputs force: a ``structured_outputs.json`` schema, else only
    ``required`` and named choices constrain."""
    if isinstance(request.json_schema, dict):
        return ToolSpec(mode="json", schema=request.json_schema)
    if ctx.tool_call_parser is None or not request.tools:
        return None
    choice = request.tool_choice
    tools = tuple(request.tools)
    if choice == "required":
        return ToolSpec(mode="required", tools=tools)
    if isinstance(choice, dict):
        return ToolSpec(mode="named", tools=tools, name=str(choice["function"]["name"]))
    return None


def _reported_cached_tokens(request: ChatRequest, engine_cached: int) -> int:
    """A decode server reports the prefill server's cache hits when P passed them on.

    ``vllm/v1/engine/output_processor.py``: with ``do_remote_prefill`` and an int
    ``remote_prefill_cached_tokens`` in the request, ``num_cached_tokens`` is replaced.
    """
    params = request.kv_transfer_params or {}
    cached = params.get("remote_prefill_cached_tokens")
    if params.get("do_remote_prefill") and isinstance(cached, int):
        return cached
    return engine_cached
