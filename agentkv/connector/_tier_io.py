"""The file tier's data path, in a vLLM worker: KV blocks straight between the KV tensors and files.

Runs where the KV tensors are (each worker process; with tensor parallelism every rank writes
and reads its own shard file). Writes and reads go through a storage-only NIXL agent with the
POSIX backend (no UCX, no progress thread: it idles at no CPU; ``docs/design/kv-tier.md`` §5):
the KV tensors are registered as DRAM once, each file as FILE_SEG for one transfer, one
descriptor per (block, layer). Where NIXL's POSIX plugin cannot be created, plain ``pwrite`` /
``pread`` on the same byte layout are used instead (logged once).

Layout of a data file: block-major, layer-minor; block ``i`` of the file is the concatenation
over layers (in ``kv_caches`` order) of ``layer[block_id]``, which is one contiguous range on the
CPU backend (``[num_blocks, kv_heads, block_size, 2 * head_size]``). The checksum of a block is
blake2b over exactly those bytes, so the scheduler can verify a file without the tensors.

The entry's last block is usually partly filled: its slots past the entry's tokens hold stale KV
of whatever used the block before, which must not leave the server in a file. They are written
as zeros (:meth:`KVLayout.masked_block`). Where a slot's bytes lie inside a block is the
attention kernel's business, not the tensor shape's: vLLM's CPU backend (``cpu_attn.py``) views a
block's ``[kv_heads, block_size, 2 * head_size]`` as keys then values per head, and its ``vec``
kernels store the keys transposed (``[head_size, block_size]``), other ISAs (AMX, NEON) as they
need. So the zeros are written by that kernel itself (:data:`ClearSlots`, from the connector),
into a copy of the block; without one the block is written whole, as before.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentkv._core import get_logger
from agentkv.connector._tier_store import CHECKSUM_BYTES

logger = get_logger("agentkv.connector.tier")

_names = itertools.count()

# Zero slots ``first..block_size-1`` of block 0 of ``cache`` (a one-block copy of layer
# ``name``'s cache, ``[1, kv_heads, block_size, 2 * head_size]``) as the attention backend lays
# them out.
ClearSlots = Callable[[str, torch.Tensor, int], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheWriter:
    """How vLLM's CPU attention backend writes one layer's cache (``do_kv_cache_update``): the
    arguments of its ``cpu_attn_reshape_and_cache`` kernel, and the dtype of the keys and values
    it is given (the model's)."""

    isa: str
    kv_cache_dtype: str
    k_scale: float
    v_scale: float
    dtype: torch.dtype


def cpu_attn_clear_slots(writers: Mapping[str, CacheWriter],
                         reshape_and_cache: Callable[..., None]) -> ClearSlots:
    """A :data:`ClearSlots` that writes zero keys and values into the slots with the backend's
    own kernel (``torch.ops._C.cpu_attn_reshape_and_cache``), so the bytes it clears are exactly
    that kernel's, whatever its ISA's layout."""

    def clear(name: str, cache: torch.Tensor, first: int) -> None:
        writer = writers[name]
        _, heads, block_size, width = cache.shape
        if first >= block_size:
            return
        zeros = torch.zeros(block_size - first, heads, width // 2, dtype=writer.dtype)
        # The backend's view: per head, block_size key rows then block_size value rows.
        key_cache, value_cache = cache.view(1, heads, 2 * block_size, -1).chunk(2, dim=2)
        slots = torch.arange(first, block_size, dtype=torch.int64)
        reshape_and_cache(zeros, zeros, key_cache, value_cache, slots, writer.isa,
                          writer.k_scale, writer.v_scale, writer.kv_cache_dtype)

    return clear


class KVLayout:
    """The worker's KV tensors, one per layer, as the tier reads and writes them."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int,
                 clear_slots: ClearSlots | None = None) -> None:
        layers: list[torch.Tensor] = []
        names: list[str] = []
        seen: set[int] = set()
        for name, tensor in kv_caches.items():
            if tensor.data_ptr() in seen:  # layers that share one cache tensor
                continue
            seen.add(tensor.data_ptr())
            if (tensor.device.type != "cpu" or tensor.shape[0] != num_blocks
                    or not tensor[0].is_contiguous()):
                raise RuntimeError(
                    "agentkv tier: KV cache layout not supported (need CPU tensors "
                    f"[num_blocks, ...], got {tuple(tensor.shape)} on {tensor.device})"
                )
            if tensor.dim() != 4 or tensor.shape[3] % 2:  # [B, H, N, 2 * head_size]
                raise RuntimeError(
                    "agentkv tier: KV cache layout not supported (need the CPU backend's "
                    f"[num_blocks, kv_heads, block_size, 2 * head_size], got {tuple(tensor.shape)})"
                )
            layers.append(tensor)
            names.append(name)
        if not layers:
            raise RuntimeError("agentkv tier: no KV cache tensors registered")
        slots = {int(t.shape[2]) for t in layers}
        if len(slots) != 1:
            raise RuntimeError("agentkv tier: the layers' KV caches differ in block size")
        self.block_size = slots.pop()
        self.layers = layers
        self.names = names
        self.clear_slots = clear_slots
        self.layer_bytes = [int(t[0].nbytes) for t in layers]
        self.block_bytes = sum(self.layer_bytes)

    def block_view(self, layer: int, block: int) -> torch.Tensor:
        return self.layers[layer][block].view(torch.uint8).reshape(-1)

    def masked_block(self, layer: int, block: int, n_valid: int) -> torch.Tensor | None:
        """A copy of ``layer[block]``'s bytes with the slots from ``n_valid`` on zeroed by the
        attention kernel (``clear_slots``); ``None`` without one. The live block is untouched."""
        if self.clear_slots is None:
            return None
        copy = self.layers[layer][block : block + 1].clone()
        self.clear_slots(self.names[layer], copy, n_valid)
        return copy.view(torch.uint8).reshape(-1)

    def checksum(self, block: int) -> str:
        h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
        for li in range(len(self.layers)):
            h.update(self.block_view(li, block).numpy())
        return h.hexdigest()


class TierIO:
    """Moves blocks between a :class:`KVLayout` and files, through NIXL POSIX when it loads."""

    def __init__(self, layout: KVLayout, *, yield_s: float = 0.0) -> None:
        """``yield_s``: sleep this long between checks of a NIXL transfer's state instead of
        spinning (a writer on a thread of its own must leave the GIL to the engine's)."""
        self.layout = layout
        self._yield_s = yield_s
        self._agent: Any = None
        self._name = f"agentkv-tier-{os.getpid()}-{next(_names)}"
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=False,
                                                             backends=[]))
            agent.create_backend("POSIX", {})
            self._dram = agent.register_memory(layout.layers)
            self._agent = agent
            self.engine = "nixl-posix"
        except Exception as exc:  # no nixl, or no POSIX plugin in this build
            logger.warning("tier_nixl_unavailable", error=repr(exc), fallback="pwrite/pread")
            self.engine = "file"

    # --- one transfer -----------------------------------------------------------------------

    def _transfer(self, op: str, fd: int, path: Path, file_blocks: Sequence[int],
                  local_blocks: Sequence[int]) -> None:
        layout = self.layout
        offsets = list(itertools.accumulate([0, *layout.layer_bytes[:-1]]))
        if self._agent is None:
            for fb, lb in zip(file_blocks, local_blocks, strict=True):
                for li, size in enumerate(layout.layer_bytes):
                    view = layout.block_view(li, lb)
                    at = fb * layout.block_bytes + offsets[li]
                    if op == "WRITE":
                        os.pwrite(fd, view.numpy(), at)
                    else:
                        data = os.pread(fd, size, at)
                        if len(data) != size:
                            raise OSError(f"short read of {path}")
                        view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return
        agent = self._agent
        length = (max(file_blocks) + 1) * layout.block_bytes
        file_reg = agent.register_memory([(0, length, fd, str(path))], "FILE")
        local = remote = handle = None
        try:
            local = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                [(layout.layers[li][lb].data_ptr(), size, 0)
                 for lb in local_blocks for li, size in enumerate(layout.layer_bytes)],
                "DRAM",
            )
            remote = agent.prep_xfer_dlist(
                self._name,  # loopback: the file is this agent's own
                [(fb * layout.block_bytes + offsets[li], size, fd)
                 for fb in file_blocks for li, size in enumerate(layout.layer_bytes)],
                "FILE",
            )
            indices = list(range(len(file_blocks) * len(layout.layers)))
            handle = agent.make_prepped_xfer(op, local, indices, remote, indices)
            state = self._wait(agent, handle, agent.transfer(handle))
            if state != "DONE":
                raise OSError(f"NIXL {op} of {path} ended in state {state}")
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            for dlist in (local, remote):
                if dlist is not None:
                    agent.release_dlist_handle(dlist)
            agent.deregister_memory(file_reg)

    def _wait(self, agent: Any, handle: Any, state: str) -> str:
        """The transfer's final state (raises nixlBackendError on a short file: a truncated
        tier entry)."""
        while state == "PROC":
            if self._yield_s:
                time.sleep(self._yield_s)
            state = agent.check_xfer_state(handle)
        return state

    # --- the tier's two operations ----------------------------------------------------------

    def write(self, path: Path, block_ids: Sequence[int], *, n_tokens: int) -> list[str]:
        """Write ``block_ids`` (in order), which hold ``n_tokens`` tokens, to a new file at
        ``path``, fsynced; the checksums of the blocks as written. The last block's slots past
        ``n_tokens`` are written as zeros."""
        layout = self.layout
        tail = n_tokens - (len(block_ids) - 1) * layout.block_size
        if block_ids and not 0 < tail <= layout.block_size:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {n_tokens} tokens")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, len(block_ids) * layout.block_bytes)
            self._transfer("WRITE", fd, path, range(len(block_ids)), block_ids)
            checksums = [layout.checksum(b) for b in block_ids]
            if block_ids and tail < layout.block_size and layout.clear_slots is not None:
                checksums[-1] = self._write_masked(fd, len(block_ids) - 1, block_ids[-1], tail)
            os.fsync(fd)
        finally:
            os.close(fd)
        return checksums

    def _write_masked(self, fd: int, file_block: int, block: int, n_valid: int) -> str:
        """Overwrite ``file_block`` with ``block`` masked past ``n_valid`` slots; its checksum.

        The live block is left as it is (the request may still be pinned and read): the zeros
        go to the file only."""
        layout = self.layout
        h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
        at = file_block * layout.block_bytes
        for li in range(len(layout.layers)):
            masked = layout.masked_block(li, block, n_valid)
            assert masked is not None  # only called with clear_slots
            data = masked.numpy()
            os.pwrite(fd, data, at)
            h.update(data)
            at += layout.layer_bytes[li]
        return h.hexdigest()

    def read(self, path: Path, file_blocks: Sequence[int], local_blocks: Sequence[int],
             checksums: Sequence[str]) -> int:
        """Read ``file_blocks`` into ``local_blocks``; the number of leading blocks that arrived
        intact (their checksums match). Anything after the first bad block is not to be used."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            logger.warning("tier_read_failed", path=str(path), error=repr(exc))
            return 0
        try:
            self._transfer("READ", fd, path, file_blocks, local_blocks)
        except Exception as exc:  # nixlBackendError on a truncated file, OSError
            logger.warning("tier_read_failed", path=str(path), error=repr(exc))
            return 0
        finally:
            os.close(fd)
        for i, (lb, expected) in enumerate(zip(local_blocks, checksums, strict=True)):
            if self.layout.checksum(lb) != expected:
                logger.warning("tier_checksum_mismatch", path=str(path), block=i)
                return i
        return len(local_blocks)


def cpu_attn_clear_slots_of(vllm_config: Any, kv_caches: Mapping[str, Any]) -> ClearSlots | None:
    """The tier's slot clearer (:data:`ClearSlots`) from the CPU attention backend's own
    cache writes, one per layer (its kernel's ISA and arguments, as ``do_kv_cache_update``
    passes them); ``None`` where a layer is not that backend's (the tier then writes the last
    block whole, stale slots included, and says so)."""
    try:
        from vllm import _custom_ops  # noqa: F401 - loads torch.ops._C, the backend's kernels

        context = vllm_config.compilation_config.static_forward_context
        by_tensor: dict[int, CacheWriter] = {}
        names: dict[str, int] = {}
        for name, tensor in kv_caches.items():
            names[name] = tensor.data_ptr()
            layer = context.get(name)
            if type(getattr(layer, "impl", None)).__name__ != "CPUAttentionBackendImpl":
                continue
            by_tensor.setdefault(tensor.data_ptr(), CacheWriter(
                isa=str(layer.isa), kv_cache_dtype=str(layer.impl.kv_cache_dtype),
                k_scale=float(layer._k_scale_float), v_scale=float(layer._v_scale_float),
                dtype=vllm_config.model_config.dtype,
            ))
        if set(names.values()) - set(by_tensor):
            raise RuntimeError("a KV cache tensor without a CPU attention layer")
        writers = {name: by_tensor[ptr] for name, ptr in names.items()}
        return cpu_attn_clear_slots(writers, torch.ops._C.cpu_attn_reshape_and_cache)
    except Exception as exc:  # any other backend or vLLM: unmasked, never no tier
        logger.warning("tier_last_block_unmasked", error=repr(exc),
                       detail="slots past an entry's tokens are written as they are")
        return None
