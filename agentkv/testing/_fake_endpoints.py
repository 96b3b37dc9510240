"""The small endpoints: ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from agentkv.testing._fake_context import ServerContext
from agentkv.testing._fake_engine import FakeEngine
from agentkv.testing._fake_protocol import schema_error, vllm_validation_error
from agentkv.testing._fake_reply import Reply
from agentkv.testing._fake_responses import random_uuid


def _as_object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise schema_error(
            "model_attributes_type",
            ("body",),
            "Input should be a valid dictionary or object to extract fields from",
            data,
        )
    return data


def tokenize(ctx: ServerContext, data: Any) -> Reply:
    """``TokenizeChatRequest`` (``messages``) or ``TokenizeCompletionRequest`` (``prompt``).

    No length limit applies (``max_total_tokens=None``), as in vLLM.
    """
    body = _as_object(data)
    ctx.check_model(body.get("model"))
    tok = ctx.tokenizer
    if "messages" in body:
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise vllm_validation_error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise schema_error(
                "list_type", ("body", "messages"), "Input should be a valid list", messages
            )
        ctx.check_chat_template(body.get("chat_template"), body.get("chat_template_kwargs"))
        text = ctx.render(
            messages,
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=bool(body.get("continue_final_message")),
        )
        ids = tok.encode(text)
    elif isinstance(body.get("prompt"), str):
        # SmolLM2's tokenizer adds no BOS, so add_special_tokens changes nothing.
        ids = tok.encode(body["prompt"])
    else:
        raise schema_error("missing", ("body", "prompt"), "Field required", body)
    strs = tok.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return Reply(
        json={
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


def detokenize(ctx: ServerContext, data: Any) -> Reply:
    """``DetokenizeRequest``: special tokens are kept in the text."""
    body = _as_object(data)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise schema_error("missing", ("body", "tokens"), "Field required", body)
    for i, token in enumerate(tokens):
        if type(token) is not int or token < 0:
            raise schema_error(
                "greater_than_equal",
                ("body", "tokens", i),
                "Input should be greater than or equal to 0",
                token,
                ge=0,
            )
    ctx.check_model(body.get("model"))
    if tokens and max(tokens) >= ctx.tokenizer.vocab_size:
        raise vllm_validation_error(f"Token id {max(tokens)} is out of vocabulary")
    return Reply(json={"prompt": ctx.tokenizer.decode(tokens)})


def models(ctx: ServerContext) -> Reply:
    """``ModelList`` with one ``ModelCard`` (``root`` is the model path on a real server)."""
    created = int(time.time())
    permission = {
        "id": f"modelperm-{random_uuid()}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": ctx.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": ctx.model,
        "parent": None,
        "max_model_len": ctx.max_model_len,
        "permission": [permission],
    }
    return Reply(json={"object": "list", "data": [card]})


def metrics(engine: FakeEngine, headers: Mapping[str, str]) -> Reply:
    text, content_type = engine.stats.render(headers.get("accept"))
    return Reply(text=text, content_type=content_type)


def health() -> Reply:
    return Reply(text=b"", content_type=None)


def http_error(status: int, phrase: str) -> Reply:
    """Starlette's own 404/405, through vLLM's ``http_exception_handler``."""
    body = {"error": {"message": phrase, "type": phrase, "param": None, "code": status}}
    return Reply.error(status, body)
