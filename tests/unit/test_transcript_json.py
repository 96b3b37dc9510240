"""A prompt's ids as JSON (what both legs send) are its token ids, however the transcript grew."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from agentkv import Message
from agentkv._prompt.transcript import Delta, Transcript, TurnPrompt

CLOSING = (2, 3)

_TURN = st.tuples(
    st.lists(st.integers(0, 2**31 - 1), max_size=6),  # the delta's new ids
    st.lists(st.integers(0, 2**31 - 1), max_size=4),  # generated ids
    st.sampled_from(["stop", "length"]),
    st.booleans(),  # fork the transcript (keeping its tokens) before this turn
)


def _turn(t: Transcript, ids: list[int], generated: list[int], finish: str) -> TurnPrompt:
    t.append(Message.user("u"))
    delta = Delta(token_ids=(1, *ids), offsets=(0,), generation_start=len(ids) + 1)
    prompt = t.prompt_for_turn(delta, closing=CLOSING)
    t.commit_turn(
        prompt, generated_ids=generated, message=Message.assistant("a"), finish_reason=finish
    )
    return prompt


@given(turns=st.lists(_TURN, min_size=1, max_size=6))
def test_json_ids_are_the_prompt_s_ids(turns: list[tuple[list[int], list[int], str, bool]]) -> None:
    t = Transcript()
    for ids, generated, finish, fork in turns:
        if fork and t.messages:
            t = t.fork(keep=len(t.messages))
        prompt = _turn(t, ids, generated, finish)
        assert prompt.json_ids() == orjson.dumps(prompt.tolist())


def test_a_prompt_built_elsewhere_serializes_its_ids() -> None:
    t = Transcript()
    prompt = _turn(t, [5, 6], [7], "stop")
    bare = TurnPrompt(
        token_ids=prompt.token_ids,
        base_version=prompt.base_version,
        base_len=prompt.base_len,
        closing_len=prompt.closing_len,
        messages=prompt.messages,
        spans=prompt.spans,
        generation_start=prompt.generation_start,
    )
    assert bare.json_ids() == prompt.json_ids() == orjson.dumps(prompt.tolist())
