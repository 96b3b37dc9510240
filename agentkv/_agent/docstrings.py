"""Tool descriptions from docstrings: the summary and one line per parameter.

Parsed with ``docstring_parser`` (pinned exactly in ``pyproject.toml``: a tool's rendered
description is part of the cached prompt prefix, so a parser change must be a deliberate one).
Google (``Args:``), Sphinx/reST (``:param name:``) and NumPy (``Parameters`` / ``----------``)
styles are read, whichever explains the most. Only what a model needs is kept: sections such as
``Returns`` or ``Examples`` are dropped, because they would grow every prompt of every agent that
uses the tool.

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
>>> parse_docstring('''Add two numbers.
...
...     Parameters
...     ----------
...     a : int
...         the first number.
...
...     Returns
...     -------
...     int
...     ''').params
{'a': 'the first number.'}
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import docstring_parser
from docstring_parser import numpydoc, rest
from docstring_parser.google import DEFAULT_SECTIONS, GoogleParser, Section, SectionType

__all__ = ["Docstring", "parse_docstring"]

# docstring_parser's Google sections, plus the spellings the Google and Napoleon guides also
# allow; a section it does not know would be read as part of the summary.
_GOOGLE_EXTRA = (
    Section("Keyword Args", "param", SectionType.MULTIPLE),
    Section("Keyword Arguments", "param", SectionType.MULTIPLE),
    Section("Kwargs", "param", SectionType.MULTIPLE),
    Section("Return", "returns", SectionType.SINGULAR_OR_MULTIPLE),
    Section("Yield", "yields", SectionType.SINGULAR_OR_MULTIPLE),
    *(
        Section(title, key, SectionType.SINGULAR)
        for title, key in (
            ("Note", "notes"),
            ("Notes", "notes"),
            ("Warning", "warnings"),
            ("Warnings", "warnings"),
            ("See Also", "see_also"),
            ("Todo", "todo"),
            ("References", "references"),
        )
    ),
)
_GOOGLE = GoogleParser(
    [
        Section(title, section.key, section.type)
        for section in (*DEFAULT_SECTIONS, *_GOOGLE_EXTRA)
        # Headers are matched case-sensitively: accept "Args:", "args:" and "See also:" too.
        for title in dict.fromkeys(
            (section.title, section.title.lower(), section.title.capitalize())
        )
    ]
)
# The order breaks ties, as in docstring_parser.parse: a docstring without sections is reST.
# Epydoc is left out: it reads the decorators of an example (``@tool``) as its ``@param`` fields.
_PARSERS = (rest.parse, _GOOGLE.parse, numpydoc.parse)
# A line may start with a reST role (":class:`Page` objects"): docstring_parser's reST parser would
# take it for a field (":param x:") and everything after it out of the summary. Roles are hidden
# behind a character no parser knows and put back afterwards.
_ROLE_AT_LINE_START = re.compile(r"^(\s*):(?=[\w.+-]+:`)", re.MULTILINE)
_HIDDEN_COLON = "\x00"


@dataclass(frozen=True, kw_only=True, slots=True)
class Docstring:
    """What a docstring says to a model: a summary and a description per parameter."""

    summary: str = ""
    params: dict[str, str] = field(default_factory=dict)


def _join(text: str | None) -> str:
    lines = (text or "").replace(_HIDDEN_COLON, ":").splitlines()
    return " ".join(line.strip() for line in lines if line.strip())


def _parse(doc: str) -> docstring_parser.Docstring:
    parsed: list[docstring_parser.Docstring] = []
    for parse in _PARSERS:
        with contextlib.suppress(docstring_parser.ParseError):  # not in this style
            parsed.append(parse(doc))
    # NumPy's parser never fails (text without its sections is all summary): never empty.
    return max(parsed, key=lambda d: len(d.meta))  # the first of the longest on a tie


def parse_docstring(doc: str | None) -> Docstring:
    """Split ``doc`` into a summary and parameter descriptions (see the module docstring)."""
    if not doc or not doc.strip():
        return Docstring()
    parsed = _parse(_ROLE_AT_LINE_START.sub(rf"\1{_HIDDEN_COLON}", doc))
    # The summary is its paragraphs, each on one line: a model reads one line as well as several.
    gap = "\n\n" if parsed.blank_after_short_description else "\n"
    text = gap.join(part for part in (parsed.short_description, parsed.long_description) if part)
    summary = "\n".join(_join(p) for p in text.split("\n\n") if p.strip())
    params = {p.arg_name.lstrip("\\*"): _join(p.description) for p in parsed.params}
    return Docstring(summary=summary, params=params)
