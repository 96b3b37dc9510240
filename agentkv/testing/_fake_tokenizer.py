"""A small, deterministic byte-level tokenizer with SmolLM2's special tokens.

Ids 0-2 are ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` (as in SmolLM2), ids 3-258
are the 256 bytes, and the rest are multi-byte *merges*. Encoding is greedy longest-match, so
the canonical encoding of a text is unique, but any other split of the same bytes decodes to
the same text: a client that re-tokenizes generated text gets different ids than the model
generated, exactly the class of bug the fake is meant to expose.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Final

ENDOFTEXT_ID: Final = 0
IM_START_ID: Final = 1
IM_END_ID: Final = 2
SPECIAL_TOKENS: Final[tuple[str, ...]] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_BYTE_OFFSET: Final = len(SPECIAL_TOKENS)

# Order is part of the vocabulary (ids follow it): append, never reorder.
# fmt: off
MERGES: Final[tuple[str, ...]] = (
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "es", "or", "ou", "it",
    "is", "ed", "al", "ar", "st", "to", "le", "ve", "se", "ha", "as", "ng", "ll", "ti",
    " t", " a", " s", " w", " c", " o", " b", " f", " m", " p", " i", " d", " h", " r",
    "the", "ing", "ion", "and", "you", "ent", "her", "tha", "for", "ere", "ter",
    " the", " to", " of", " and", " in", " is", " it", " that", " for", " you", " with",
    " on", " be", " as", " are", " this", " can", " cache", " token", " tool",
    "The", "What", "Paris", "France", "capital", "assistant", "user", "system", "tool",
    "\n\n", "  ", "Hugging", " Face", "SmolLM", " helpful",
    '{"', '":', '": ', '", "', '"}', '}]', '[{"', "name", "parameters", "arguments",
    "<think>", "</think>",
)
# fmt: on

_SPECIAL_RE: Final = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes, used for ``token_strs`` (``Ġ`` is a space)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class FakeTokenizer:
    """Deterministic, reversible tokenizer used by the fake servers.

    Example:
        >>> tok = FakeTokenizer()
        >>> ids = tok.encode("<|im_start|>user\\nthe cache<|im_end|>")
        >>> ids[0] == tok.im_start_id and ids[-1] == tok.eos_token_id
        True
        >>> tok.decode(ids)
        '<|im_start|>user\\nthe cache<|im_end|>'
        >>> tok.encode("the") == [tok.token_to_id("the")]
        True
    """

    eos_token_id: Final = IM_END_ID
    im_start_id: Final = IM_START_ID
    endoftext_id: Final = ENDOFTEXT_ID

    def __init__(self) -> None:
        pieces: list[bytes] = [s.encode() for s in SPECIAL_TOKENS]
        pieces += [bytes([b]) for b in range(256)]
        pieces += [m.encode() for m in MERGES]
        self._pieces: tuple[bytes, ...] = tuple(pieces)
        self._ids: dict[bytes, int] = {
            piece: i for i, piece in enumerate(pieces) if i >= _BYTE_OFFSET
        }
        by_length = sorted({m.encode() for m in MERGES}, key=len, reverse=True)
        # Alternation tries longest merges first, so findall is greedy longest-match.
        alternatives = b"|".join(re.escape(m) for m in by_length)
        self._merge_re = re.compile(alternatives + b"|.", re.DOTALL)
        self.max_chars_per_token: int = max(len(p) for p in pieces)

    @property
    def vocab_size(self) -> int:
        """Number of ids; every id below it decodes."""
        return len(self._pieces)

    def token_to_id(self, piece: str) -> int:
        """Id of a special token, a single byte or a merge."""
        if piece in SPECIAL_TOKENS:
            return SPECIAL_TOKENS.index(piece)
        return self._ids[piece.encode()]

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < _BYTE_OFFSET

    def encode(self, text: str) -> list[int]:
        """Canonical (greedy longest-match) ids; special-token text becomes special ids."""
        ids: list[int] = []
        pos = 0
        for match in _SPECIAL_RE.finditer(text):
            ids += self._encode_plain(text[pos : match.start()])
            ids.append(SPECIAL_TOKENS.index(match.group()))
            pos = match.end()
        ids += self._encode_plain(text[pos:])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._ids
        return [ids[piece] for piece in self._merge_re.findall(text.encode())]

    def byte_ids(self, text: str) -> list[int]:
        """The longest possible (one id per byte) encoding: valid, never canonical."""
        return [_BYTE_OFFSET + b for b in text.encode()]

    def piece(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        pieces = self._pieces
        data = b"".join(pieces[i] for i in ids if not (skip_special_tokens and i < _BYTE_OFFSET))
        return data.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Token strings as a byte-level BPE tokenizer shows them (``Ġthe`` for `` the``)."""
        table = _bytes_to_unicode()
        out: list[str] = []
        for i in ids:
            if i < _BYTE_OFFSET:
                out.append(SPECIAL_TOKENS[i])
            else:
                out.append("".join(table[b] for b in self._pieces[i]))
        return out
