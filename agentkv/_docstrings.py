"""Tool descriptions from docstrings: the summary and one line per parameter.

Google style (``Args:`` sections) and Sphinx style (``:param name:``) are read; anything else is
the summary. Only what a model needs is kept: sections such as ``Returns:`` or ``Example:`` are
dropped, because they would grow every prompt of every agent that uses the tool.

>>> doc = parse_docstring('''Add two numbers.
...
...     Args:
...         a: the first number.
...         b (float): the second
...             number.
...     Returns:
...         the sum.
...     ''')
>>> doc.summary, doc.params
('Add two numbers.', {'a': 'the first number.', 'b': 'the second number.'})
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

__all__ = ["Docstring", "parse_docstring"]

_PARAM_SECTIONS = frozenset({"args", "arguments", "parameters", "params", "keyword args"})
_OTHER_SECTIONS = frozenset(
    {
        "returns",
        "return",
        "yields",
        "raises",
        "example",
        "examples",
        "note",
        "notes",
        "see also",
        "attributes",
        "warning",
        "warnings",
    }
)
_SECTION = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
_GOOGLE_PARAM = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[\w\[\], .|]+\s+)?(\w+)\s*:\s*(.*)$")
_SPHINX_OTHER = re.compile(r"^:(?:type|rtype|returns?|raises?)\b")


@dataclass(frozen=True, kw_only=True, slots=True)
class Docstring:
    """What a docstring says to a model: a summary and a description per parameter."""

    summary: str = ""
    params: dict[str, str] = field(default_factory=dict)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _join(lines: list[str]) -> str:
    return " ".join(part.strip() for part in lines if part.strip())


def parse_docstring(doc: str | None) -> Docstring:
    """Split ``doc`` into a summary and parameter descriptions (see the module docstring)."""
    if not doc:
        return Docstring()
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    params: dict[str, list[str]] = {}
    section: str | None = None
    current: str | None = None
    param_indent = 0
    for line in lines:
        stripped = line.strip()
        header = _SECTION.match(stripped)
        if (
            header
            and _indent(line) == 0
            and header.group(1).lower() in (_PARAM_SECTIONS | _OTHER_SECTIONS)
        ):
            section = header.group(1).lower()
            current = None
            continue
        sphinx = _SPHINX_PARAM.match(stripped)
        if sphinx:
            section, current = "sphinx", sphinx.group(1)
            params[current] = [sphinx.group(2)]
            continue
        if _SPHINX_OTHER.match(stripped):
            section, current = "sphinx-other", None
            continue
        if section is None:
            summary.append(line)
        elif section in _PARAM_SECTIONS:
            google = _GOOGLE_PARAM.match(stripped)
            if google and (current is None or _indent(line) <= param_indent):
                current = google.group(1)
                param_indent = _indent(line)
                params[current] = [google.group(2)]
            elif current is not None and stripped:
                params[current].append(stripped)
        elif section == "sphinx" and current is not None and stripped:
            params[current].append(stripped)
    # The summary is its paragraphs joined: a model reads one line as well as several.
    paragraphs = "\n".join(summary).strip().split("\n\n")
    text = "\n".join(_join(p.splitlines()) for p in paragraphs if p.strip())
    return Docstring(summary=text, params={k: _join(v) for k, v in params.items()})
