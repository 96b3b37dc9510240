"""JSON in and out of the wire, on orjson (a hard dependency).

A turn serializes the whole prompt's token ids twice (prefill and decode legs) and parses them back
once (decode echoes them with ``return_token_ids``); with the standard library that alone is ~1 ms
at 8k tokens, with orjson ~0.1 ms. ``fragment`` serializes a value once for embedding in several
bodies.

>>> loads(dumps({"prompt_token_ids": [1, 2]}))
{'prompt_token_ids': [1, 2]}
>>> dumps({"a": fragment([1, 2])})
b'{"a":[1,2]}'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "JSONDecodeError",
    "dumps",
    "fragment",
    "json_fragment",
    "loads",
    "loads_without",
    "tools_key",
]

# A subclass of the standard library's json.JSONDecodeError (and of ValueError).
JSONDecodeError = orjson.JSONDecodeError


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


_INT_LIST_BYTES = b"0123456789-, \t\r\n"


def loads_without(data: bytes, key: str) -> Any:
    """``loads(data)`` with the first ``"key":[...]`` list of integers read as ``null``, unparsed.

    For an answer's long echo nobody reads (decode's ``prompt_token_ids``): parsing 8k ints costs
    more than the rest of the answer. The match is exact: inside a JSON string every ``"`` is
    escaped, so the unescaped bytes ``"key":[`` only occur as a key; a span that is not plain
    integers (a nested list, strings, ``]`` elsewhere) is parsed as it is.

    >>> loads_without(b'{"a":"[1]","p":[1, -2],"b":[3]}', "p")
    {'a': '[1]', 'p': None, 'b': [3]}
    """
    start = data.find(b'"' + key.encode() + b'":[')
    if start < 0:
        return orjson.loads(data)
    open_at = start + len(key) + 3
    end = data.find(b"]", open_at)
    if end < 0 or data[open_at + 1 : end].translate(None, _INT_LIST_BYTES):
        return orjson.loads(data)
    return orjson.loads(data[:open_at] + b"null" + data[end + 1 :])


def fragment(obj: Any) -> Any:
    """``obj`` serialized once, embeddable in later ``dumps`` calls."""
    return orjson.Fragment(orjson.dumps(obj))


def json_fragment(data: bytes) -> Any:
    """``data`` (JSON already serialized) embeddable in later ``dumps`` calls as it is."""
    return orjson.Fragment(data)


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A stable key for a tools list (templates render tools into the prompt); key order in the
    tool definitions does not matter. Saved sessions hold it: its form never changes."""
    return json.dumps(tools, sort_keys=True, separators=(",", ":")) if tools else ""
