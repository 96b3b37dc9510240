"""Tell wrong KV from numeric drift: a turn's logprobs against a cold, teacher-forced reference.

A turn that reused KV (pulled from decode, or hit in prefill's cache) must behave as if its whole
prompt had been computed afresh. Exact greedy equality is the strongest check, but not one the
numerics always allow: in bf16 on a CPU without native bf16 arithmetic, decode (one token at a
time) and prefill (a whole chunk) round differently, and a near-tie between two tokens can flip
(docs/cpu.md measures it). Wrong KV is different in kind: another prefix's blocks behind a prompt
move next-token logprobs by whole nats, drift by hundredths.

The reference: the turn's prompt and its generated tokens sent once more as one prompt, to a
server of the pair, with ``prompt_logprobs`` and a fresh ``cache_salt`` (so no cached block can
be reused): the logprob of each generated token given everything before it, computed cold, in
one prefill. ``DriftReport`` compares that with the logprobs decode reported for the turn
(``extra_body={"logprobs": True}``, ``TurnResult.logprobs``).

>>> report = logprob_drift([-0.5, -1.0], [{7: -0.5}, {9: -1.25, 3: -0.3}], [7, 9])
>>> report.max_abs, report.worst_position
(0.25, 1)
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx2

__all__ = ["DriftReport", "logprob_drift", "teacher_forced_logprobs", "tie_gap"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DriftReport:
    """How far a turn's logprobs lie from the cold reference, over its generated tokens."""

    tokens: int
    max_abs: float
    mean_abs: float
    worst_position: int | None  # index into the generated tokens, None when there are none

    def within(self, tolerance: float) -> bool:
        return self.max_abs <= tolerance


def teacher_forced_logprobs(
    server: str,
    *,
    model: str,
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    top: int = 2,
    client: httpx2.Client | None = None,
    timeout_s: float = 300.0,
) -> tuple[dict[int, float], ...]:
    """For each generated token: the reference logprobs at its position, computed cold.

    Each entry maps token id to logprob and holds the generated token and the ``top`` most likely
    tokens there. ``server`` is a vLLM base URL; the request carries no ``kv_transfer_params``,
    so no KV moves and none is pinned.
    """
    body = {
        "model": model,
        "prompt": [*prompt_ids, *generated_ids],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": top,
        # A salt no other request used: every block is computed, none is read from the cache.
        "cache_salt": uuid.uuid4().hex,
    }
    own = client is None
    http = client or httpx2.Client(timeout=timeout_s)
    try:
        response = http.post(f"{server.rstrip('/')}/v1/completions", json=body)
        response.raise_for_status()
        rows = response.json()["choices"][0]["prompt_logprobs"]
    finally:
        if own:
            http.close()
    start = len(prompt_ids)
    if not isinstance(rows, list) or len(rows) != start + len(generated_ids):
        expected = start + len(generated_ids)
        raise ValueError(f"expected {expected} prompt_logprobs rows from {server}")
    return tuple(
        {int(token): float(entry["logprob"]) for token, entry in rows[start + i].items()}
        for i in range(len(generated_ids))
    )


def logprob_drift(
    observed: Sequence[float],
    reference: Sequence[Mapping[int, float]],
    token_ids: Sequence[int],
) -> DriftReport:
    """Compare observed logprobs of ``token_ids`` with the reference's, position by position."""
    if not len(observed) == len(reference) == len(token_ids):
        raise ValueError(
            f"lengths differ: {len(observed)} observed, {len(reference)} reference, "
            f"{len(token_ids)} tokens"
        )
    gaps = [
        abs(seen - expected[token]) if token in expected else math.inf
        for seen, expected, token in zip(observed, reference, token_ids, strict=True)
    ]
    if not gaps:
        return DriftReport(tokens=0, max_abs=0.0, mean_abs=0.0, worst_position=None)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return DriftReport(
        tokens=len(gaps),
        max_abs=gaps[worst],
        mean_abs=sum(gaps) / len(gaps),
        worst_position=worst,
    )


def tie_gap(reference: Mapping[int, float], a: int, b: int) -> float:
    """How far apart tokens ``a`` and ``b`` are at one position of the reference (inf: one is not
    among its most likely tokens, so the two were no near-tie).

    >>> tie_gap({5: -0.70, 6: -0.69}, 5, 6) < 0.02
    True
    """
    if a not in reference or b not in reference:
        return math.inf
    return abs(reference[a] - reference[b])
