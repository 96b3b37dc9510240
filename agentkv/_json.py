"""JSON in and out of the wire, with orjson when it is installed.

A turn serializes the whole prompt's token ids twice (prefill and decode legs) and parses them back
once (decode echoes them with ``return_token_ids``); with the standard library that alone is ~1 ms
at 8k tokens, with orjson ~0.1 ms. ``fragment`` serializes a value once for embedding in several
bodies.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["dumps", "fragment", "loads"]

try:
    import orjson
except ImportError:  # pragma: no cover - exercised only where orjson is missing
    orjson = None  # type: ignore[assignment]


if orjson is not None:

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    def loads(data: bytes | str) -> Any:
        return orjson.loads(data)

    def fragment(obj: Any) -> Any:
        """``obj`` serialized once, embeddable in later ``dumps`` calls."""
        return orjson.Fragment(orjson.dumps(obj))

else:  # pragma: no cover

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    def loads(data: bytes | str) -> Any:
        return json.loads(data)

    def fragment(obj: Any) -> Any:
        return obj


JSONDecodeError = json.JSONDecodeError
