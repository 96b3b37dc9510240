"""The context-window decisions (``agentkv._window``): pure functions of the counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import ConfigError, ContextLengthError
from agentkv._window import check_oversized, context_error, fit_max_tokens


@given(
    asked=st.integers(1, 100_000),
    prompt=st.integers(1, 40_000),
    limit=st.integers(2, 40_000),
)
def test_a_clamped_ask_always_fits_and_never_grows(asked: int, prompt: int, limit: int) -> None:
    if prompt >= limit:
        with pytest.raises(ContextLengthError) as caught:
            fit_max_tokens(asked, prompt_tokens=prompt, limit=limit, refuse=False)
        assert caught.value.max_tokens is None
        return
    given_ = fit_max_tokens(asked, prompt_tokens=prompt, limit=limit, refuse=False)
    assert 1 <= given_ <= asked
    assert prompt + given_ <= limit
    assert given_ == asked or prompt + given_ == limit


def test_refuse_raises_with_the_counts_instead_of_clamping() -> None:
    with pytest.raises(ContextLengthError) as caught:
        fit_max_tokens(32000, prompt_tokens=1000, limit=8192, refuse=True)
    assert (caught.value.prompt_tokens, caught.value.max_tokens, caught.value.limit) == (
        1000, 32000, 8192,
    )
    assert fit_max_tokens(7192, prompt_tokens=1000, limit=8192, refuse=True) == 7192


def test_an_unknown_window_sends_the_ask_as_it_is() -> None:
    assert fit_max_tokens(32000, prompt_tokens=10**6, limit=None, refuse=True) == 32000


@pytest.mark.parametrize(
    ("message", "max_tokens", "limit"),
    [
        ("max_completion_tokens=9000 cannot be greater than max_model_len=8192. Please "
         "request fewer output tokens.", 9000, 8192),
        ("This model's maximum context length is 8192 tokens. However, your prompt contains "
         "40000 characters (more than 32768 characters, which is the upper bound for 8192 "
         "input tokens). Please reduce the length of the input prompt.", None, 8192),
        ("Input length (9000) exceeds model's maximum context length (8192).", None, 8192),
        ("The engine prompt length 9000 exceeds the max_model_len 8192. Please reduce prompt.",
         None, 8192),
        ("max_tokens must be at least 1, got 0.", None, 4096),
    ],
)
def test_vllms_context_messages_map_to_one_error(
    message: str, max_tokens: int | None, limit: int
) -> None:
    err = context_error(message, prompt_tokens=9000, limit=4096)
    assert err is not None
    assert (err.prompt_tokens, err.max_tokens, err.limit) == (9000, max_tokens, limit)


def test_other_messages_are_not_context_errors() -> None:
    assert context_error("max_tokens must be at least 1, got -5.", prompt_tokens=1, limit=9) \
        is not None  # negative: the prompt over the window
    assert context_error("top_p must be in (0, 1], got 2.", prompt_tokens=1, limit=9) is None


def test_oversized_max_tokens_values() -> None:
    assert check_oversized("refuse") == "refuse"
    with pytest.raises(ConfigError):
        check_oversized("drop")
