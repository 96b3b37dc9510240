"""Every sync/async twin offers the same public calls, with the same parameters.

A twin's annotations name the other twin's types (``Session`` where the async one says
``AsyncSession``), so parameters are compared by name, kind and default, not by annotation.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import agentkv

# Async name -> sync name, where they differ.
RENAMED = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
# Members one twin has on purpose, with the reason.
ASYNC_ONLY = {
    # Asyncio clients, bound to the sync twin's private loop thread: no use to sync callers.
    ("AsyncCluster", "http_client"),
    ("AsyncCluster", "poster"),
}
# Twins whose constructors differ on purpose (the sync one wraps an async one).
OWN_CONSTRUCTORS = {"Session", "AsyncSession"}
TWINS = [
    ("Cluster", "AsyncCluster"),
    ("Session", "AsyncSession"),
    ("OpenAI", "AsyncOpenAI"),
    ("Agent", "AsyncAgent"),
]


def _members(cls: type) -> dict[str, Any]:
    """Public members the class (or one of agentkv's bases) defines, by their sync name."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("agentkv"):
            continue
        for name, value in vars(klass).items():
            wanted = not name.startswith("_") or name in RENAMED.values() or name in RENAMED
            if name == "__init__" and cls.__name__ not in OWN_CONSTRUCTORS:
                wanted = True
            if wanted and (cls.__name__, name) not in ASYNC_ONLY:
                found[RENAMED.get(name, name)] = value
    return found


def _parameters(member: Any) -> list[tuple[str, Any, Any]] | str:
    if isinstance(member, property):
        return "property"
    if isinstance(member, classmethod | staticmethod):
        member = member.__func__
    if not callable(member):
        return "attribute"
    return [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()]


@pytest.mark.parametrize(("sync", "async_"), TWINS)
def test_twins_have_the_same_public_calls_and_parameters(sync: str, async_: str) -> None:
    sync_members = _members(getattr(agentkv, sync))
    async_members = _members(getattr(agentkv, async_))
    assert sorted(sync_members) == sorted(async_members)
    for name, member in sync_members.items():
        assert _parameters(member) == _parameters(async_members[name]), f"{sync}.{name}"


def test_the_twin_check_sees_a_missing_call_and_a_different_parameter() -> None:
    class Sync:
        __module__ = "agentkv.example"

        def turn(self, *, final: bool = False) -> None: ...

    class Async:
        __module__ = "agentkv.example"

        async def turn(self, *, final: bool = True) -> None: ...

        async def fork(self) -> None: ...

    assert sorted(_members(Sync)) != sorted(_members(Async))
    assert _parameters(_members(Sync)["turn"]) != _parameters(_members(Async)["turn"])


# Twins whose common calls are written once, in a base both take: each twin's own body holds
# only what differs by side (an ``async def`` and its blocking counterpart), never a second copy
# of a parameter list. (The sessions' twins are another step's.)
WRITTEN_ONCE = [("Cluster", "AsyncCluster"), ("OpenAI", "AsyncOpenAI")]


def _own(cls: type) -> dict[str, Any]:
    """Public members and the constructor that the class's own body defines, by sync name."""
    return {
        RENAMED.get(name, name): value
        for name, value in vars(cls).items()
        if not name.startswith("_")
        or name == "__init__"
        or name in RENAMED
        or name in RENAMED.values()
    }


def _written_twice(sync: type, async_: type) -> list[str]:
    sync_own, async_own = _own(sync), _own(async_)
    return sorted(
        name
        for name in sync_own.keys() & async_own.keys()
        if not inspect.iscoroutinefunction(async_own[name])
        or inspect.iscoroutinefunction(sync_own[name])
    )


@pytest.mark.parametrize(("sync", "async_"), WRITTEN_ONCE)
def test_twins_write_their_common_calls_once(sync: str, async_: str) -> None:
    assert _written_twice(getattr(agentkv, sync), getattr(agentkv, async_)) == []


def test_the_written_once_check_sees_a_call_in_both_twins() -> None:
    class Sync:
        def __init__(self, *, name: str) -> None: ...

        def close(self) -> None: ...

        def session(self) -> None: ...

    class Async:
        def __init__(self, *, name: str) -> None: ...

        async def aclose(self) -> None: ...

        def session(self) -> None: ...

    assert _written_twice(Sync, Async) == ["__init__", "session"]
