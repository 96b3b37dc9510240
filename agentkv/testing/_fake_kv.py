"""KV blocks of the fake engine: a block pool with prefix caching, and what a block holds.

A real KV block holds keys and values computed for some tokens *in some context*. The fake keeps
exactly that identity: the tokens of the block and ``ctx``, the hash of everything before the
block when it was computed. A block read positionally into another request therefore carries its
history along: if that history is not the new prompt's, the request's KV state differs from a
clean run, and so does the model's output.

The pool mirrors vLLM's ``BlockPool``: block 0 is the null block, free blocks form an LRU queue
(freed tail-first, allocated from the head), and a freed block keeps its content and prefix-cache
entry until it is allocated again. That is why reading a consumed or expired handle "works" on a
real server and returns whatever those blocks hold by then.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

ROOT_HASH: Final = 0x5EED_CAFE


def chain(parent: int, tokens: Sequence[int]) -> int:
    """Hash of a block given the hash of what precedes it (vLLM's chained block hash)."""
    return hash((parent, tuple(tokens)))


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Prefix-cache keys of the full blocks of ``tokens``."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class BlockContent:
    """What a block's KV represents: ``tokens`` computed after a history hashed as ``ctx``."""

    ctx: int
    tokens: list[int]

    def copy(self) -> BlockContent:
        return BlockContent(ctx=self.ctx, tokens=list(self.tokens))


def is_true_content(
    content: BlockContent, tokens: Sequence[int], index: int, hashes: Sequence[int], bs: int
) -> bool:
    """Whether ``content`` is what a clean prefill of ``tokens`` holds in block ``index``.

    ``hashes`` are ``block_hashes(tokens, bs)``.
    """
    start = index * bs
    parent = ROOT_HASH if index == 0 else hashes[index - 1]
    expected = list(tokens[start : start + len(content.tokens)])
    return content.ctx == parent and content.tokens == expected


def write_tokens(
    blocks: list[BlockContent], tokens: Sequence[int], start: int, end: int, bs: int
) -> None:
    """Compute positions ``[start, end)`` of ``tokens`` on top of ``blocks`` (in place).

    A position overwrites whatever a block held from there on; a new block's ``ctx`` is the
    hash of the blocks actually before it, right or wrong.
    """
    pos = start
    while pos < end:
        index, offset = divmod(pos, bs)
        if index == len(blocks):
            parent = blocks[-1] if blocks else None
            ctx = ROOT_HASH if parent is None else chain(parent.ctx, parent.tokens)
            blocks.append(BlockContent(ctx=ctx, tokens=[]))
        n = min(bs - offset, end - pos)
        blocks[index].tokens[offset:] = tokens[pos : pos + n]
        pos += n


def kv_state(blocks: Iterable[BlockContent]) -> int:
    """One number for all the KV a request attends to; the model's output depends on it."""
    return hash(tuple((b.ctx, tuple(b.tokens)) for b in blocks))


class KVCacheFullError(RuntimeError):
    """No free block left (a real server would queue the request instead)."""


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    content: BlockContent = field(default_factory=lambda: BlockContent(ROOT_HASH, []))


class BlockPool:
    """Fixed pool of blocks with a prefix cache, reference counts and an LRU free queue."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("the pool needs the null block and at least one more")
        self._num_blocks = num_blocks
        # Blocks are materialized on first use: a fresh pool costs next to nothing.
        self._blocks: dict[int, _Block] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, int] = {}

    def _block(self, block_id: int) -> _Block:
        block = self._blocks.get(block_id)
        if block is None:
            block = self._blocks[block_id] = _Block(block_id)
        return block

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: share of non-null blocks that are referenced."""
        return 1.0 - len(self._free) / (self._num_blocks - 1)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Ids of the cached blocks for the longest cached prefix of ``hashes``."""
        hits: list[int] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self._block(block_id)
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFullError(f"needs {n} free KV blocks, {len(self._free)} left")
        ids: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self._block(block_id)
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None
            block.content = BlockContent(ROOT_HASH, [])
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; tail blocks become evictable first."""
        for block_id in reversed(block_ids):
            block = self._block(block_id)
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: int) -> None:
        block = self._block(block_id)
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block_id

    def read(self, block_id: int) -> BlockContent:
        """Content of any block, referenced or not (a NIXL read does not ask)."""
        if not 0 < block_id < self._num_blocks:
            raise IndexError(f"block {block_id} is outside the KV cache")
        return self._block(block_id).content.copy()

    def held(self, block_id: int) -> bool:
        """Whether some request still holds the block (a freed one may be handed out any time)."""
        block = self._blocks.get(block_id)
        return block is not None and block.ref_cnt > 0

    def write(self, block_id: int, content: BlockContent) -> None:
        self._block(block_id).content = content.copy()
