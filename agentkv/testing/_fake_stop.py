"""Stop strings, checked as vLLM 0.32's front end checks them (``v1/engine/detokenizer.py``).

vLLM detokenizes each new token and searches the text for the request's ``stop`` strings; the
first one to complete ends the request there: ``finish_reason: "stop"``, ``stop_reason`` the
string, the text cut at its start (or after it with ``include_stop_str_in_output``), and the
token ids kept up to and including the token that completed it. The engine never finished the
request itself, so the front end aborts it: decode pins nothing and the answer carries
``kv_transfer_params: null``.

>>> from agentkv.testing._fake_tokenizer import FakeTokenizer
>>> tok = FakeTokenizer()
>>> ids = tok.encode("Action: search\\nObservation: none")
>>> hit = find_stop(tok, ids, stop=("Observation:",), include=False, min_tokens=0)
>>> hit.text, hit.stop_string, tok.decode(ids[: hit.num_tokens]).endswith("Observation:")
('Action: search\\n', 'Observation:', True)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from agentkv.testing._fake_tokenizer import FakeTokenizer

__all__ = ["StopHit", "find_stop", "stop_buffer_length"]


@dataclass(frozen=True, kw_only=True)
class StopHit:
    """Where a stop string ended a generation."""

    stop_string: str
    num_tokens: int  # token ids kept: up to and including the one completing the stop string
    text: str  # the output text, truncated as vLLM truncates it


def _check(
    text: str, new_chars: int, stop: Sequence[str], include: bool
) -> tuple[str, int, int] | None:
    """``check_stop_strings``: (string, truncate_to or -1, end of the string in the text)."""
    if not new_chars or not stop:
        return None
    best: tuple[str, int, int] | None = None
    best_end = sys.maxsize
    for stop_str in stop:
        index = text.find(stop_str, 1 - new_chars - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:
            best, best_end = (stop_str, index, end), end
    if best is None:
        return None
    stop_str, index, end = best
    if include:
        return stop_str, (-1 if end >= len(text) else end), end
    return stop_str, index, end


def find_stop(
    tok: FakeTokenizer,
    token_ids: Sequence[int],
    *,
    stop: Sequence[str],
    include: bool,
    min_tokens: int,
) -> StopHit | None:
    """The first stop string the generation completes, token by token, or ``None``."""
    if not stop:
        return None
    text = ""
    for i in range(len(token_ids)):
        before = len(text)
        # Special tokens (the end of turn among them) add no text, as vLLM skips them.
        text = tok.decode(token_ids[: i + 1], skip_special_tokens=True)
        if i + 1 <= min_tokens:
            continue
        hit = _check(text, len(text) - before, stop, include)
        if hit is not None:
            stop_string, truncate_to, _ = hit
            return StopHit(
                stop_string=stop_string,
                num_tokens=i + 1,
                text=text if truncate_to == -1 else text[:truncate_to],
            )
    return None


def stop_buffer_length(stop: Sequence[str], *, include: bool) -> int:
    """Characters a stream holds back so that it never shows part of a stop string."""
    return max(len(s) for s in stop) - 1 if stop and not include else 0
