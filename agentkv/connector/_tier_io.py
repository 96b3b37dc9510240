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
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from agentkv.connector._tier_store import CHECKSUM_BYTES

logger = structlog.get_logger("agentkv.connector.tier")

_names = itertools.count()


class KVLayout:
    """The worker's KV tensors, one per layer, as the tier reads and writes them."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int) -> None:
        layers: list[torch.Tensor] = []
        seen: set[int] = set()
        for tensor in kv_caches.values():
            if tensor.data_ptr() in seen:  # layers that share one cache tensor
                continue
            seen.add(tensor.data_ptr())
            if (tensor.device.type != "cpu" or tensor.shape[0] != num_blocks
                    or not tensor[0].is_contiguous()):
                raise RuntimeError(
                    "agentkv tier: KV cache layout not supported (need CPU tensors "
                    f"[num_blocks, ...], got {tuple(tensor.shape)} on {tensor.device})"
                )
            layers.append(tensor)
        if not layers:
            raise RuntimeError("agentkv tier: no KV cache tensors registered")
        self.layers = layers
        self.layer_bytes = [int(t[0].nbytes) for t in layers]
        self.block_bytes = sum(self.layer_bytes)

    def block_view(self, layer: int, block: int) -> torch.Tensor:
        return self.layers[layer][block].view(torch.uint8).reshape(-1)

    def checksum(self, block: int) -> str:
        h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
        for li in range(len(self.layers)):
            h.update(self.block_view(li, block).numpy())
        return h.hexdigest()


class TierIO:
    """Moves blocks between a :class:`KVLayout` and files, through NIXL POSIX when it loads."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
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
            state = agent.transfer(handle)
            while state == "PROC":
                # Raises nixlBackendError on a short file (a truncated tier entry).
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"NIXL {op} of {path} ended in state {state}")
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            for dlist in (local, remote):
                if dlist is not None:
                    agent.release_dlist_handle(dlist)
            agent.deregister_memory(file_reg)

    # --- the tier's two operations ----------------------------------------------------------

    def write(self, path: Path, block_ids: Sequence[int]) -> list[str]:
        """Write ``block_ids`` (in order) to a new file at ``path``, fsynced; their checksums."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, len(block_ids) * self.layout.block_bytes)
            self._transfer("WRITE", fd, path, range(len(block_ids)), block_ids)
            os.fsync(fd)
        finally:
            os.close(fd)
        return [self.layout.checksum(b) for b in block_ids]

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
