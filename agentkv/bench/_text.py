"""Synthetic text in the styles an agent's context is made of: tool schemas, code, logs, prose.

Every generator is a pure function of a ``random.Random`` and a character budget, so a workload is
reproducible from its seed. The text is shaped like the real thing (JSON schemas that parse, code
that looks like code, pytest-style logs) because tokenizers split those styles differently and the
benchmark sizes its prompts in tokens.

>>> import random
>>> text = generate("code", random.Random(0), 400)
>>> 380 <= len(text) <= 400
True
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Literal, TypeAlias

__all__ = ["STYLES", "Style", "generate", "ident", "seeded", "tool_schema"]

Style: TypeAlias = Literal["schema", "code", "log", "prose"]
STYLES: tuple[Style, ...] = ("schema", "code", "log", "prose")

_NOUNS = (
    "invoice", "customer", "ledger", "account", "order", "payment", "report", "session", "cache",
    "token", "request", "config", "schema", "record", "batch", "queue", "worker", "shard", "index",
    "snapshot", "policy", "tenant", "region", "bucket", "artifact", "pipeline", "release", "ticket",
)
_VERBS = (
    "get", "list", "create", "update", "delete", "search", "fetch", "sync", "validate", "render",
    "export", "import", "merge", "resolve", "schedule", "cancel", "retry", "archive", "inspect",
)
_TYPES = ("string", "integer", "boolean", "number")
_WORDS = (
    "the", "a", "function", "returns", "value", "when", "if", "field", "is", "missing", "call",
    "tool", "result", "with", "for", "each", "item", "in", "list", "error", "must", "be", "valid",
    "user", "file", "path", "line", "test", "fails", "because", "expected", "actual", "rounding",
    "total", "amount", "currency", "step", "before", "after", "check", "output", "only", "once",
)


def seeded(label: str) -> random.Random:
    """A generator seeded by ``label``: the workload must be reproducible, not unpredictable."""
    return random.Random(label)  # noqa: S311 - synthetic text, reproducibility is the point


def ident(rng: random.Random) -> str:
    """A tool-ish identifier such as ``sync_ledger``."""
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def tool_schema(rng: random.Random, name: str) -> str:
    """One OpenAI-style function schema as compact JSON text."""
    properties = {}
    for _ in range(rng.randint(2, 5)):
        param = rng.choice(_NOUNS) + rng.choice(("_id", "_name", "_limit", "_path", "", "_at"))
        properties[param] = {
            "type": rng.choice(_TYPES),
            "description": _sentence(rng, rng.randint(4, 10)),
        }
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": _sentence(rng, rng.randint(8, 18)),
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": sorted(properties)[: rng.randint(1, len(properties))],
            },
        },
    }
    return json.dumps(schema, separators=(", ", ": "))


def _schema_line(rng: random.Random) -> str:
    return tool_schema(rng, ident(rng))


def _code_line(rng: random.Random) -> str:
    kind = rng.random()
    noun, other = rng.choice(_NOUNS), rng.choice(_NOUNS)
    if kind < 0.15:
        return f"def {ident(rng)}({noun}: {other.title()}, *, limit: int = {rng.randint(1, 500)}):"
    if kind < 0.3:
        return f"    if {noun}.{other} is None or {noun}.total < {rng.randint(0, 99)}:"
    if kind < 0.45:
        return f"        raise ValueError(f\"bad {noun}: {{{noun}.{other}!r}}\")"
    if kind < 0.65:
        factor, digits = f"{rng.random():.4f}", rng.randint(0, 4)
        return f"    {noun}_{other} = round({noun}.amount * {factor}, {digits})"
    if kind < 0.8:
        status = rng.choice(_VERBS)
        return f"    return [{other} for {other} in {noun}s if {other}.status == \"{status}\"]"
    return f"    # {_sentence(rng, rng.randint(5, 12))}"


def _log_line(rng: random.Random) -> str:
    kind = rng.random()
    path = f"tests/test_{rng.choice(_NOUNS)}.py"
    if kind < 0.4:
        status = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"))
        return f"{path}::test_{ident(rng)} {status} [{rng.randint(1, 99):3d}%]"
    if kind < 0.6:
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        return f"E       AssertionError: assert {a / 100:.2f} == {b / 100:.2f}"
    if kind < 0.8:
        return f"{path}:{rng.randint(10, 900)}: in test_{ident(rng)}"
    return f"INFO {rng.choice(_NOUNS)}.{rng.choice(_VERBS)} took {rng.randint(1, 2000)} ms"


def _prose_line(rng: random.Random) -> str:
    return _sentence(rng, rng.randint(8, 20))


_LINES: dict[Style, Callable[[random.Random], str]] = {
    "schema": _schema_line,
    "code": _code_line,
    "log": _log_line,
    "prose": _prose_line,
}


def generate(style: Style, rng: random.Random, chars: int) -> str:
    """Whole lines of ``style`` up to ``chars`` characters (the last line cut to fit)."""
    line = _LINES[style]
    out: list[str] = []
    size = 0
    while size < chars:
        text = line(rng)
        out.append(text)
        size += len(text) + 1
    return "\n".join(out)[:chars].rstrip()
