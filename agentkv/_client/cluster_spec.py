"""Cluster specs: the ``{"model", "pairs"}`` object (or a prefill pool and decode servers)
that ``agentkv up`` writes to a cluster file, read into pairs, a model and options."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentkv._client.pool import ClusterOptions
from agentkv._exceptions import ConfigError
from agentkv._policy import CachePolicy
from agentkv._route import RouteCostModel, RoutePolicy
from agentkv._types import Pair
from agentkv._wire.json import JSONDecodeError, loads

__all__ = ["merge_options", "parse_spec", "read_spec"]


def _servers(raw: object, role: str, source: str) -> list[tuple[str, str]]:
    """A pool's list of servers: URLs, or ``{"name", "url"}`` objects."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: '{role}' must be a non-empty list")
    servers = []
    for index, item in enumerate(raw):
        name, url = f"{role}{index}", item
        if isinstance(item, Mapping):
            name, url = item.get("name", name), item.get("url")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: {role}[{index}] needs a non-empty name")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{source}: {role}[{index}] must be an http(s) URL, got {url!r}")
        servers.append((name, url.rstrip("/")))
    if len({name for name, _ in servers}) != len(servers):
        raise ConfigError(f"{source}: duplicate names in '{role}'")
    return servers


def parse_spec(spec: object, source: str) -> tuple[list[Pair], str, ClusterOptions]:
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"{source}: a cluster spec is an object with 'model' and 'pairs' "
            "(or 'prefill' and 'decode' lists, a pool)"
        )
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{source}: 'model' must be a non-empty string")
    extra: ClusterOptions = {}
    if "block_size" in spec:
        extra["block_size"] = spec["block_size"]
    if "max_model_len" in spec:  # agentkv up records it; the pool validates it
        extra["max_model_len"] = spec["max_model_len"]
    threshold = spec.get("kv_recompute_threshold")
    policy: dict[str, Any] = {}
    if threshold is not None:
        # The servers' own threshold: handles are worth attaching down to it (the local pair
        # pulls whatever prefill lacks: 1), not only down to vLLM's default 64.
        if type(threshold) is not int or threshold < 0:
            raise ConfigError(f"{source}: 'kv_recompute_threshold' must be a non-negative integer")
        policy["recompute_threshold"] = threshold
    if "route_cost" in spec:  # measured by `agentkv calibrate`: what `route="auto"` decides by
        policy["route"] = RoutePolicy(cost=RouteCostModel.from_wire(spec["route_cost"],
                                                                    source=source))
    if policy:
        extra["policy"] = CachePolicy(**policy)
    if "pairs" not in spec and ("prefill" in spec or "decode" in spec):
        prefills = _servers(spec.get("prefill"), "prefill", source)
        decodes = _servers(spec.get("decode"), "decode", source)
        extra["prefill_pool"] = dict(prefills)
        # In a pool a "pair" is a decode server; each turn picks its prefill from the pool.
        return (
            [Pair(name=name, prefill=prefills[0][1], decode=url) for name, url in decodes],
            model,
            extra,
        )
    raw_pairs = spec.get("pairs")
    if not isinstance(raw_pairs, list) or not raw_pairs:
        raise ConfigError(f"{source}: 'pairs' must be a non-empty list")
    pairs = []
    for index, raw in enumerate(raw_pairs):
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: pairs[{index}] is not an object")
        pairs.append(
            Pair(
                name=raw.get("name", f"pair{index}"),
                prefill=raw.get("prefill"),  # type: ignore[arg-type]  # Pair validates
                decode=raw.get("decode"),  # type: ignore[arg-type]
            )
        )
    return pairs, model, extra


def merge_options(spec: ClusterOptions, given: ClusterOptions) -> ClusterOptions:
    """The options a spec sets, overridden by those given in the call."""
    merged = spec.copy()
    merged.update(given)
    return merged


def read_spec(path: str | Path) -> object:
    try:
        return loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"no cluster file at {path}; start one with `agentkv up`") from None
    except (OSError, JSONDecodeError) as exc:
        raise ConfigError(f"cluster file {path} is unreadable: {exc}") from exc
