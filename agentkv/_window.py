"""A turn's context window: how many tokens its answer may take; when its prompt does not fit.

Pure decisions, in one place for every front end (the SDK's turns, and through them the proxy's
chat completions, Responses and Messages APIs):

* ``fit_max_tokens``: the turn's ``max_tokens`` once its prompt's exact length is known (the
  SDK renders the prompt client-side, token-exact, before the P leg). Agents ask for far more
  than a small model's window holds (Claude Code and OpenCode send ``max_tokens: 32000``; the
  local model's window is 8192): an ask above what the prompt leaves is clamped to it (vLLM
  itself clamps silently up to ``max_model_len``, and refuses above it), or refused when the
  caller wants strictness. A prompt that leaves no room for one token is always a
  ``ContextLengthError``.
* ``context_error``: vLLM's own 400s about the context, as the same ``ContextLengthError``, in
  case the client-side count and the server's ever differ.

>>> fit_max_tokens(32000, prompt_tokens=1000, limit=8192, refuse=False)
7192
>>> fit_max_tokens(256, prompt_tokens=1000, limit=8192, refuse=True)
256
"""

from __future__ import annotations

import re
from typing import Literal

from agentkv._exceptions import ConfigError, ContextLengthError

__all__ = ["OversizedMaxTokens", "check_oversized", "context_error", "fit_max_tokens"]

OversizedMaxTokens = Literal["clamp", "refuse"]
"""What a turn does with a ``max_tokens`` above what its prompt leaves of the context."""

_OVERSIZED = ("clamp", "refuse")


def check_oversized(value: object) -> OversizedMaxTokens:
    """``value`` as an ``OversizedMaxTokens``; ``ConfigError`` for anything else."""
    if value not in _OVERSIZED:
        raise ConfigError(f"oversized_max_tokens must be 'clamp' or 'refuse', got {value!r}")
    return value  # type: ignore[return-value]  # checked just above


def fit_max_tokens(asked: int, *, prompt_tokens: int, limit: int | None, refuse: bool) -> int:
    """The ``max_tokens`` a turn sends: ``asked``, or what ``limit`` leaves after the prompt.

    ``limit`` is the model's context (``max_model_len``; ``None`` when unknown: ``asked`` goes
    as it is and the server decides). ``ContextLengthError`` when the prompt leaves no room for
    one token (``max_tokens=None``), or, with ``refuse``, when ``asked`` does not fit.

    >>> fit_max_tokens(10, prompt_tokens=8192, limit=8192, refuse=False)
    Traceback (most recent call last):
    ...
    agentkv.ContextLengthError: the prompt is 8192 tokens, over the context of 8192
    """
    if limit is None:
        return asked
    room = limit - prompt_tokens
    if room < 1:
        raise ContextLengthError(prompt_tokens=prompt_tokens, max_tokens=None, limit=limit)
    if asked <= room:
        return asked
    if refuse:
        raise ContextLengthError(prompt_tokens=prompt_tokens, max_tokens=asked, limit=limit)
    return room


# vLLM 0.32's refusals about the context (vllm/renderers/params.py, vllm/entrypoints/serve/
# utils/api_utils.py, vllm/entrypoints/openai/responses/serving.py, vllm/sampling_params.py).
# Each names the context (group "limit") where it can; the output ask ("asked") where it is
# about that.
_PROMPT_OVER = (
    # "This model's maximum context length is 8192 tokens. However, your prompt contains ..."
    re.compile(r"maximum context length is (?P<limit>\d+) tokens"),
    # "Input length (9000) exceeds model's maximum context length (8192)."
    re.compile(r"Input length \(\d+\) exceeds model's maximum context length \((?P<limit>\d+)\)"),
    # "The engine prompt length 9000 exceeds the max_model_len 8192. Please reduce prompt."
    re.compile(r"prompt length \d+ exceeds the max_model_len (?P<limit>\d+)"),
    # A prompt of exactly max_model_len tokens leaves max_tokens 0 (get_max_tokens).
    re.compile(r"max_tokens must be at least 1, got (?:0|-\d+)"),
)
# "max_tokens=32000 cannot be greater than max_model_len=8192. Please request fewer output tokens."
_ASK_OVER = re.compile(
    r"(?:max_tokens|max_completion_tokens)=(?P<asked>\d+) cannot be greater than"
    r" max_model_len=(?P<limit>\d+)"
)


def context_error(
    message: str, *, prompt_tokens: int, limit: int | None
) -> ContextLengthError | None:
    """The ``ContextLengthError`` a vLLM 400 ``message`` is about, else ``None``.

    ``prompt_tokens`` is the prompt's exact length as the SDK rendered it; ``limit`` the context
    as known here (the message's own figure wins).

    >>> context_error("max_tokens=32000 cannot be greater than max_model_len=8192. Please "
    ...               "request fewer output tokens.", prompt_tokens=900, limit=None).max_tokens
    32000
    >>> context_error("temperature must be non-negative", prompt_tokens=900, limit=8192) is None
    True
    """
    found = _ASK_OVER.search(message)
    if found is not None:
        return ContextLengthError(
            prompt_tokens=prompt_tokens,
            max_tokens=int(found["asked"]),
            limit=int(found["limit"]),
        )
    for pattern in _PROMPT_OVER:
        found = pattern.search(message)
        if found is None:
            continue
        named = found.groupdict().get("limit")
        known = int(named) if named is not None else limit
        return ContextLengthError(
            prompt_tokens=prompt_tokens,
            max_tokens=None,
            limit=known if known is not None else prompt_tokens,
        )
    return None
