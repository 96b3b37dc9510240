"""NIXL's POSIX storage backend on the CPU build: KV-cache blocks to a file and back, zero copy.

    .venv/bin/python benchmarks/kv_tier/nixl_posix.py [--blocks 16] [--repeats 5] [--dtype float32]

Evidence for the design study docs/design/kv-tier.md (issue 20). It shows:

- which build the ``nixl`` meta-package imports on a machine without CUDA, and which storage
  plugins load there: POSIX does; GDS, GDS_MT and OBJ do not (``ldd`` names the missing
  libraries);
- that a storage-only agent (no UCX backend, no progress thread) uses no CPU while idle;
- a write of KV blocks laid out as vLLM's CPU backend keeps them (one tensor per layer,
  ``[num_blocks, kv_heads, block_size, 2 * head_size]``, sized like SmolLM2-135M: 30 layers,
  3 KV heads, head size 64, 128-token blocks), straight from the layer tensors into a file
  registered as FILE_SEG, then a read of the file back into *other* blocks of the same tensors:
  one descriptor per (block, layer), no staging buffer. Byte-exact, timed with each POSIX I/O
  engine (POSIX AIO, the default; libaio; io_uring), median of ``--repeats``;
- what a damaged file does: a truncated file makes ``check_xfer_state`` raise
  ``nixlBackendError``; corruption of the right length is read back silently (NIXL has no
  checksum), so the tier must keep its own;
- ``query_memory`` on a FILE descriptor: size and mtime, or None for a missing file.

Reads come from the page cache (``drop_caches`` needs root), so they flatter a cold disk. Files
are written in a ``tempfile.TemporaryDirectory()`` that is removed at the end. No vLLM server is
started.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# SmolLM2-135M-Instruct, as the local pair serves it (CPU block size 128).
LAYERS = 30
KV_HEADS = 3
HEAD_SIZE = 64
BLOCK_TOKENS = 128

ENGINES: dict[str, dict[str, str]] = {
    "posix_aio (default)": {},
    "libaio": {"use_posix_aio": "false", "use_uring": "false", "use_aio": "true"},
    "io_uring": {"use_posix_aio": "false", "use_uring": "true", "use_aio": "false"},
}
STORAGE_PLUGINS = ("POSIX", "GDS", "GDS_MT", "OBJ")


def _missing_libraries(plugin_file: Path) -> list[str]:
    """Shared libraries ``ldd`` cannot find, other than NIXL's own (found at run time)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return ["(ldd not available)"]
    out = subprocess.run([ldd, str(plugin_file)], capture_output=True, text=True, check=False)
    own = ("libnixl", "libfile_utils", "libobj_utils", "libserdes")
    return [
        line.split()[0]
        for line in out.stdout.splitlines()
        if "not found" in line and not line.strip().startswith(own)
    ]


def report_plugins(agent: Any, nixl_module: str) -> None:
    package_dir = Path(__import__(nixl_module).__file__).parent
    plugin_dirs = [
        package_dir.parent / f".{nixl_module}.mesonpy.libs" / "plugins",
        package_dir.parent / f"{nixl_module}.libs" / "nixl",
    ]
    print("plugins listed:", ", ".join(agent.get_plugin_list()))
    for name in STORAGE_PLUGINS:
        try:
            agent.create_backend(name, {})
        except Exception as exc:
            files = [d / f"libplugin_{name}.so" for d in plugin_dirs if d.is_dir()]
            missing = _missing_libraries(files[0]) if files else ["(plugin file not found)"]
            print(f"  {name:7s} create_backend -> {type(exc).__name__}; ldd: missing {missing}")
        else:
            print(f"  {name:7s} loads; mem types {agent.get_backend_mem_types(name)}")
    print("POSIX parameters:", agent.get_plugin_params("POSIX"))


def block_layer_bytes(layers: list[torch.Tensor]) -> int:
    """One layer's share of one block (per head and token, K and V side by side on CPU)."""
    return layers[0][0].nbytes


class Tier:
    """One storage-only NIXL agent with the layer tensors (DRAM) and one file (FILE) registered."""

    def __init__(
        self, name: str, params: dict[str, str], layers: list[torch.Tensor], path: Path
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("POSIX", params)
        self.layers = layers
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.dram = self.agent.register_memory(layers)
        n_blocks = layers[0].shape[0] // 2
        self.block_bytes = block_layer_bytes(layers)
        self.file_bytes = n_blocks * LAYERS * self.block_bytes
        # FILE_SEG descriptor: (offset, length, fd, metadata); the fd is the device id.
        self.file = self.agent.register_memory([(0, self.file_bytes, self.fd, str(path))], "FILE")

    def transfer(self, op: str, blocks: list[int]) -> tuple[str, float]:
        """WRITE blocks (or READ into them); the file is block-major, layer-minor."""
        local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            [(layer[b].data_ptr(), self.block_bytes, 0) for b in blocks for layer in self.layers],
            "DRAM",
        )
        remote = self.agent.prep_xfer_dlist(
            self.name,  # loopback: the file belongs to this agent
            [
                ((i * LAYERS + li) * self.block_bytes, self.block_bytes, self.fd)
                for i in range(len(blocks))
                for li in range(LAYERS)
            ],
            "FILE",
        )
        indices = list(range(len(blocks) * LAYERS))
        handle = self.agent.make_prepped_xfer(op, local, indices, remote, indices)
        start = time.perf_counter()
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            return state, time.perf_counter() - start
        finally:
            self.agent.release_xfer_handle(handle)
            self.agent.release_dlist_handle(local)
            self.agent.release_dlist_handle(remote)

    def close(self) -> None:
        self.agent.deregister_memory(self.file)
        self.agent.deregister_memory(self.dram)
        os.close(self.fd)


def blocks_equal(layers: list[torch.Tensor], src: list[int], dst: list[int]) -> bool:
    # Compared as int16 bit patterns: exact, and much faster than bf16 equality on CPU.
    return all(
        torch.equal(layer[src].view(torch.int16), layer[dst].view(torch.int16)) for layer in layers
    )


def file_matches(path: Path, layers: list[torch.Tensor], blocks: list[int]) -> bool:
    expected = hashlib.sha256()
    for b in blocks:
        for layer in layers:
            expected.update(layer[b].contiguous().view(torch.uint8).numpy().tobytes())
    return hashlib.sha256(path.read_bytes()).digest() == expected.digest()


def time_engines(layers: list[torch.Tensor], n: int, repeats: int, tmp: Path) -> None:
    src, dst = list(range(n)), list(range(n, 2 * n))
    total = n * LAYERS * block_layer_bytes(layers)

    def fmt(times: list[float]) -> str:
        med = statistics.median(times)
        return f"{1e3 * med:6.1f} ms ({total / med / 1e9:5.2f} GB/s)"

    for i, (engine, params) in enumerate(ENGINES.items()):
        tier = Tier(f"tier{i}", params, layers, tmp / f"{i}.kv")
        writes, syncs, reads, exact = [], [], [], True
        try:
            for _ in range(repeats):
                for layer in layers:
                    layer[n:].zero_()
                state, dt = tier.transfer("WRITE", src)
                assert state == "DONE", state
                writes.append(dt)
                start = time.perf_counter()
                os.fsync(tier.fd)
                syncs.append(time.perf_counter() - start)
                exact &= file_matches(tier.path, layers, src)
                state, dt = tier.transfer("READ", dst)
                assert state == "DONE", state
                reads.append(dt)
                exact &= blocks_equal(layers, src, dst)
        finally:
            tier.close()
        print(
            f"{engine:20s} write {fmt(writes)}  fsync {1e3 * statistics.median(syncs):6.1f} ms"
            f"  read (page cache) {fmt(reads)}  byte-exact: {exact}"
        )


def damaged_file(layers: list[torch.Tensor], n: int, tmp: Path) -> None:
    src, dst = list(range(n)), list(range(n, 2 * n))
    total = n * LAYERS * block_layer_bytes(layers)
    print("\ndamaged files (default engine):")
    tier = Tier("damage", {}, layers, tmp / "damage.kv")
    try:
        assert tier.transfer("WRITE", src)[0] == "DONE"
        os.fsync(tier.fd)
        query = tier.agent.query_memory(
            [(0, 0, 0, str(tier.path)), (0, 0, 0, str(tier.path) + ".missing")], "POSIX", "FILE"
        )
        print("  query_memory(file, missing file) ->", query)
        with tier.path.open("r+b") as f:  # flip one byte in the middle, same length
            f.seek(total // 2)
            byte = f.read(1)
            f.seek(total // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        state, _ = tier.transfer("READ", dst)
        print(
            f"  one byte flipped: READ -> {state}; blocks equal to the originals: "
            f"{blocks_equal(layers, src, dst)} (no checksum)"
        )
        os.truncate(tier.path, total // 4)
        try:
            state, _ = tier.transfer("READ", dst)
            print(f"  truncated to 1/4: READ -> {state}")
        except Exception as exc:
            print(f"  truncated to 1/4: READ raised {type(exc).__name__}: {exc}")
    finally:
        tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16, help="128-token blocks per transfer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="KV dtype (agentkv up serves float32 on CPUs without native bf16: docs/cpu.md)",
    )
    args = parser.parse_args()

    from nixl._api import nixl_agent, nixl_agent_config

    # The meta-package picks a build (nixl_cu12, nixl_cu13, ...) at import time.
    nixl_module = nixl_agent.__module__.split(".")[0]
    print("nixl imports", nixl_module)
    probe = nixl_agent("plugin_probe", nixl_agent_config(enable_prog_thread=False, backends=[]))
    report_plugins(probe, nixl_module)
    cpu = time.process_time()
    time.sleep(2.0)
    print(f"storage-only agent, idle 2 s: {1e3 * (time.process_time() - cpu):.1f} ms CPU")

    n = args.blocks
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    layers = [
        torch.randn(2 * n, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE, generator=gen).to(dtype)
        for _ in range(LAYERS)
    ]
    per_layer = block_layer_bytes(layers)
    print(
        f"\nKV layout: {LAYERS} layer tensors {tuple(layers[0].shape)} {args.dtype}; "
        f"{LAYERS * per_layer // BLOCK_TOKENS} B/token, {LAYERS * per_layer} B per "
        f"{BLOCK_TOKENS}-token block; transfer = {n} blocks ({n * BLOCK_TOKENS} tokens) = "
        f"{n * LAYERS} descriptors of {per_layer} B = {n * LAYERS * per_layer / 1e6:.1f} MB"
    )
    with tempfile.TemporaryDirectory(prefix="agentkv-kvtier-") as tmp:
        time_engines(layers, n, args.repeats, Path(tmp))
        damaged_file(layers, n, Path(tmp))
    print("temporary directory removed:", not Path(tmp).exists())


if __name__ == "__main__":
    main()
