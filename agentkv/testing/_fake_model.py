"""The fake model: greedy, deterministic, and a function of the KV it holds.

The engine reduces the KV behind a prompt to one integer (``kv_state``); everything the model
generates is derived from it with a seeded PRNG. Two requests whose KV is the same get the same
tokens; a request whose pulled KV was wrong gets different tokens, just as wrong KV on a real
server changes greedy output.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from agentkv.testing._fake_tokenizer import IM_END_ID, FakeTokenizer

# fmt: off
_WORDS: Final = (
    "the", "capital", "of", "France", "is", "Paris", "a", "model", "answer", "agent",
    "tool", "cache", "token", "result", "value", "first", "next", "turn", "data", "file",
    "search", "query", "plan", "step", "check", "done", "more", "other", "this", "that",
    "with", "from", "into", "about", "there", "here", "ready", "fast", "reuse", "prefix",
    "block", "remote", "local", "server", "client", "session", "thinking", "then", "and",
    "in", "it", "for", "you", "on", "be", "are", "can", "helpful", "store", "order",
)
# fmt: on
_MIN_REPLY: Final = 8
_MAX_REPLY: Final = 40
_SPLIT_PROBABILITY: Final = 0.2

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """What the tool-call grammar forces: ``required`` (any tool) or a ``named`` one."""

    mode: Literal["required", "named", "json"]
    tools: tuple[Mapping[str, Any], ...] = ()
    name: str | None = None
    # ``json``: an instance of this schema (``structured_outputs.json``).
    schema: Mapping[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Generation:
    token_ids: list[int]
    finish_reason: FinishReason


class FakeModel:
    """Generates replies from a KV state.

    Example:
        >>> from agentkv.testing import FakeTokenizer
        >>> model = FakeModel(FakeTokenizer())
        >>> a = model.generate(1234, max_tokens=100)
        >>> a == model.generate(1234, max_tokens=100)
        True
        >>> a.token_ids[-1] == FakeTokenizer.eos_token_id, a.finish_reason
        (True, 'stop')
    """

    def __init__(self, tokenizer: FakeTokenizer, *, reasoning: bool = False) -> None:
        self._tok = tokenizer
        self._reasoning = reasoning

    def generate(
        self,
        kv_state: int,
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        tool: ToolSpec | None = None,
    ) -> Generation:
        # Seeded for determinism; nothing here is security-relevant.
        rng = random.Random(kv_state)  # noqa: S311
        if tool is not None:
            return self._truncate([*self._tool_call_ids(rng, tool), IM_END_ID], max_tokens)
        out: list[int] = []
        target = rng.randint(_MIN_REPLY, _MAX_REPLY)
        for token, may_stop in self._text_stream(rng):
            if len(out) >= max_tokens:
                break
            out.append(token)
            if may_stop and not ignore_eos and len(out) >= max(target - 1, min_tokens):
                out.append(IM_END_ID)
                break
        return self._truncate(out, max_tokens)

    @staticmethod
    def _truncate(ids: list[int], max_tokens: int) -> Generation:
        if len(ids) > max_tokens or (len(ids) == max_tokens and ids[-1] != IM_END_ID):
            return Generation(token_ids=ids[:max_tokens], finish_reason="length")
        return Generation(token_ids=ids, finish_reason="stop")

    def _text_stream(self, rng: random.Random) -> Iterator[tuple[int, bool]]:
        """Endless sentences; ``may_stop`` marks where an end-of-turn may follow."""
        if self._reasoning:
            yield from ((t, False) for t in self._tok.encode("<think>\n"))
            for word in self._sentence(rng, rng.randint(3, 8)):
                yield from ((t, False) for t in word)
            yield from ((t, False) for t in self._tok.encode(".\n</think>\n\n"))
        while True:
            words = self._sentence(rng, rng.randint(4, 12))
            for word in words:
                yield from ((t, False) for t in word)
            yield from ((t, True) for t in self._tok.encode("."))
            yield from ((t, False) for t in self._tok.encode(" "))

    def _sentence(self, rng: random.Random, n_words: int) -> list[list[int]]:
        words: list[list[int]] = []
        for i in range(n_words):
            word = rng.choice(_WORDS)
            text = word.capitalize() if i == 0 else f" {word}"
            ids = self._tok.encode(text)
            if rng.random() < _SPLIT_PROBABILITY:
                ids = self._non_canonical(ids, rng)
            words.append(ids)
        return words

    def _non_canonical(self, ids: list[int], rng: random.Random) -> list[int]:
        """Split one merged token into bytes: same text, ids a re-tokenizer won't produce."""
        merged = [i for i, t in enumerate(ids) if len(self._tok.piece(t)) > 1]
        if not merged:
            return ids
        at = rng.choice(merged)
        piece = self._tok.piece(ids[at]).decode()
        return [*ids[:at], *self._tok.byte_ids(piece), *ids[at + 1 :]]

    def _tool_call_ids(self, rng: random.Random, tool: ToolSpec) -> list[int]:
        return self._tok.encode(tool_call_text(rng, tool))


def tool_call_text(rng: random.Random, tool: ToolSpec) -> str:
    """What structured outputs force for ``tool_choice``.

    ``required``: a JSON array of ``{"name", "parameters"}`` objects (vLLM's schema for
    required tool calls); ``named``: the function's arguments object alone.
    """
    if tool.mode == "json":
        return json.dumps(_value(rng, tool.schema or {}))
    functions = {str(_function(t).get("name")): _function(t) for t in tool.tools}
    if tool.mode == "named":
        function = functions[str(tool.name)]
        return json.dumps(_arguments(rng, function.get("parameters")))
    name = rng.choice(sorted(functions))
    arguments = _arguments(rng, functions[name].get("parameters"))
    return json.dumps([{"name": name, "parameters": arguments}])


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else {}


def _arguments(rng: random.Random, schema: Any) -> dict[str, Any]:
    if not isinstance(schema, Mapping):
        return {}
    value = _value(rng, schema)
    return value if isinstance(value, dict) else {}


def _value(rng: random.Random, schema: Mapping[str, Any]) -> Any:
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _value(rng, rng.choice(options))
    enum = schema.get("enum")
    if isinstance(enum, Sequence) and not isinstance(enum, str) and enum:
        return rng.choice(list(enum))
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object":
        properties = schema.get("properties")
        props = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        names = [n for n in required if n in props] if isinstance(required, list) else []
        return {n: _value(rng, props[n]) for n in names}
    if kind == "array":
        items = schema.get("items")
        count = max(1, int(schema.get("minItems", 1)))
        return [_value(rng, items) for _ in range(count)] if isinstance(items, Mapping) else []
    scalars: dict[str, Callable[[], Any]] = {
        "integer": lambda: rng.randint(0, 100),
        "number": lambda: round(rng.uniform(0, 100), 2),
        "boolean": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }
    return scalars.get(str(kind), lambda: rng.choice(_WORDS))()
