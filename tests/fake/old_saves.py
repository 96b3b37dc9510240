"""Save files as older versions of agentkv wrote them, made from today's: the loaders' tests."""

from __future__ import annotations

from typing import Any


def as_version_3(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a save file's dict, version 4: one tagged ``kv`` object) as version 3 wrote it:
    the KV spread over ``handle``, ``tier``, ``lost`` and ``wait_note``."""
    kv = dict(data.pop("kv"))
    kind, note = kv.pop("kind"), kv.pop("note")
    data["handle"] = kv["handle"] if kind == "pinned" else None
    data["tier"] = kv if kind == "tier" else None
    data["lost"] = [kv["reason"], kv["detail"]] if kind == "none" else None
    data["wait_note"] = note
    data["version"] = 3
    return data
