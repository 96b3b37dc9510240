"""Which request fields may reach a turn: one table for the SDK, the Agent, LangChain and the proxy.

agentkv sends every turn as exact prompt token ids (``kv_transfer_params.prompt_token_ids``) and
threads decode's KV by position. A field that makes vLLM render, tokenize, truncate or extend the
prompt differently from agentkv's transcript, or that addresses KV, would put wrong KV behind the
transcript or be silently dropped: such fields are **refused** (``InvalidMessageError`` in the
SDK, HTTP 400 in the proxy), naming the field and why. Fields that only shape sampling or the
output **pass** to the decode leg. The table follows vLLM 0.32's ``ChatCompletionRequest``
(``vllm/entrypoints/openai/chat_completion/protocol.py``); its default values are harmless and
accepted (``echo: false``, ``add_generation_prompt: true``, ...).

>>> refusal("echo", True)
"'echo' makes vLLM re-render the messages and ignore the prompt token ids"
>>> refusal("echo", False) is None, refusal("seed", 7) is None
(True, True)
>>> check_extra_body({"n": 2})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
agentkv.InvalidMessageError: 'n': 2 is refused: 'n' above 1 runs one request per...
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from agentkv._exceptions import InvalidMessageError

__all__ = ["PASSED_FIELDS", "REFUSED_FIELDS", "check_extra_body", "refusal"]

_RENDER = "the prompt is sent as exact token ids, so vLLM would not apply it"
_SENTINEL: Final = object()

# name -> (harmless value, why any other value is refused). ``_SENTINEL``: no value is harmless.
_REFUSED: Final[dict[str, tuple[Any, str]]] = {
    "echo": (False, "makes vLLM re-render the messages and ignore the prompt token ids"),
    "chat_template": (None, f"changes how the messages become tokens; {_RENDER}"),
    "chat_template_kwargs": (None, f"changes how the messages become tokens; {_RENDER}"),
    "add_generation_prompt": (True, f"changes the prompt's closing tokens; {_RENDER}"),
    "continue_final_message": (False, f"changes the prompt's closing tokens; {_RENDER}"),
    "add_special_tokens": (False, f"adds tokens to the prompt; {_RENDER}"),
    "documents": (None, f"is rendered into the prompt by the chat template; {_RENDER}"),
    "reasoning_effort": (None, f"is rendered into the prompt by the chat template; {_RENDER}"),
    "truncate_prompt_tokens": (None, "drops prompt tokens the transcript and the KV still hold"),
    "truncation_side": (None, "drops prompt tokens the transcript and the KV still hold"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported by token-exact turns"),
    "media_io_kwargs": (None, "multimodal inputs are not supported by token-exact turns"),
    "mm_payload": (None, "multimodal inputs are not supported by token-exact turns"),
    "prompt_token_ids": (_SENTINEL, "the prompt's tokens come from the session's transcript"),
    "prompt_embeds": (_SENTINEL, "the prompt's tokens come from the session's transcript"),
    "kv_transfer_params": (_SENTINEL, "addresses KV blocks; agentkv sets it for each leg"),
    "ec_transfer_params": (_SENTINEL, "addresses encoder cache on another server"),
    "vllm_xargs": (_SENTINEL, "goes into the engine's extra_args, where KV transfer params live"),
    "use_beam_search": (
        False,
        "runs many requests; the turn-end KV would belong to one of them, not the answer",
    ),
    "n": (
        1,
        "above 1 runs one request per choice, and the turn-end KV would come from whichever "
        "finished last; fork the session once per choice instead",
    ),
}
REFUSED_FIELDS: Final[Mapping[str, str]] = MappingProxyType(
    {name: reason for name, (_, reason) in _REFUSED.items()}
)
"""Fields refused unless they hold their harmless default, with the reason."""

PASSED_FIELDS: Final = frozenset(
    {
        "allowed_token_ids",
        "bad_words",
        "frequency_penalty",
        "ignore_eos",
        "include_reasoning",
        "include_stop_str_in_output",
        "length_penalty",
        "logit_bias",
        "min_p",
        "min_tokens",
        "parallel_tool_calls",
        "presence_penalty",
        "priority",
        "repetition_detection",
        "repetition_penalty",
        "response_format",
        "seed",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream_interval",
        "structured_outputs",
        "thinking_token_budget",
        "top_k",
        "top_p",
        "watermarking",
    }
)
"""Fields that only shape sampling or the output: sent to the decode leg unchanged."""


def refusal(name: str, value: object) -> str | None:
    """Why ``name: value`` may not reach a turn (a sentence naming the field), else ``None``."""
    entry = _REFUSED.get(name)
    if entry is None:
        return None
    harmless, reason = entry
    if value is None or (harmless is not _SENTINEL and value == harmless):
        return None
    return f"'{name}' {reason}"


def check_extra_body(extra: Mapping[str, Any]) -> None:
    """Refuse (``InvalidMessageError``) an ``extra_body`` field that changes the prompt's tokens.

    Every path into a turn (``Session``, ``Agent``, ``ChatAgentKV``, the proxy) goes through it.
    """
    for name, value in extra.items():
        reason = refusal(name, value)
        if reason is not None:
            raise InvalidMessageError(f"'{name}': {value!r} is refused: {reason}")


# The tool_choice values of agentkv's tool-calling protocols (``ToolCalling.turn_options``): the
# OpenAI API's three, and agentkv's own "final".
AUTO = "auto"
"""Choice: the model calls any tool, or answers."""
FINAL = "final"
"""Choice: the model must give its final answer now."""
NONE = "none"
"""Choice: plain text, no tool calls."""
REQUIRED = "required"
"""Choice: the model must call one of the tools (not the final one) now."""
