"""``Session``: the sync twin of ``AsyncSession``, driving it on the cluster's loop thread.

Its calls are made from ``AsyncSession``'s methods (``_blocking``, ``_iterating``,
``_holding``): each parameter list is written once, on the async side, and the twins cannot
drift (``tests/unit/test_twins.py`` checks the signatures anyway).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from agentkv._client import kv
from agentkv._client.portal import Portal
from agentkv._client.session_async import AsyncSession
from agentkv._client.session_base import SessionBase

__all__ = ["Session", "SessionHost"]

P = ParamSpec("P")
T = TypeVar("T")


class SessionHost(Protocol):
    """What ``Session.load`` needs of a cluster (``Cluster`` is one)."""

    def load_session(self, path: str | os.PathLike[str]) -> Session: ...


def _blocking(
    method: Callable[Concatenate[AsyncSession, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Session, P], T]:
    """The sync twin of a coroutine method: checked open here, awaited on the loop thread."""

    @functools.wraps(method)
    def call(self: Session, /, *args: P.args, **kwargs: P.kwargs) -> T:
        self._check_open()
        return self._portal.call(method(self._inner, *args, **kwargs))

    return call


def _iterating(
    method: Callable[Concatenate[AsyncSession, P], AsyncIterator[T]],
) -> Callable[Concatenate[Session, P], Iterator[T]]:
    """The sync twin of a method returning an async iterator (its checks run here, at once)."""

    @functools.wraps(method)
    def call(self: Session, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._portal.iterate(method(self._inner, *args, **kwargs))

    return call


def _holding(
    method: Callable[Concatenate[AsyncSession, P], AbstractAsyncContextManager[T]],
) -> Callable[Concatenate[Session, P], contextlib.AbstractContextManager[T]]:
    """The sync twin of an async context manager method: entered and exited on the loop."""

    @functools.wraps(method)
    @contextlib.contextmanager
    def call(self: Session, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        self._check_open()
        manager = method(self._inner, *args, **kwargs)
        value = self._portal.call(manager.__aenter__())
        try:
            yield value
        except BaseException as exc:
            # A closed cluster's loop thread is gone, and the session with it: nothing to exit.
            if self._pool.closed or not self._portal.call(
                manager.__aexit__(type(exc), exc, exc.__traceback__)
            ):
                raise
        else:
            if not self._pool.closed:
                self._portal.call(manager.__aexit__(None, None, None))

    return call


def _on_loop(
    method: Callable[Concatenate[AsyncSession, P], AsyncSession],
) -> Callable[Concatenate[Session, P], Session]:
    """The sync twin of a method opening a session: run on the loop (it takes a place on a
    pair), the new session wrapped."""

    @functools.wraps(method)
    def call(self: Session, /, *args: P.args, **kwargs: P.kwargs) -> Session:
        async def _run() -> AsyncSession:
            return method(self._inner, *args, **kwargs)

        self._check_open()
        return Session(self._portal.call(_run()), portal=self._portal)

    return call


class Session(SessionBase):
    """The sync twin of ``AsyncSession``. Open with ``Cluster.session()``; not thread-safe.

    >>> with cluster.session() as s:  # doctest: +SKIP
    ...     s.append(Message.user("Tell me a story."))
    ...     for event in s.stream():
    ...         if isinstance(event, TextDelta):
    ...             print(event.text, end="")
    """

    def __init__(self, inner: AsyncSession, *, portal: Portal) -> None:
        self._inner = inner
        self._state = inner._state
        self._pool = inner._pool
        self._portal = portal

    @classmethod
    def load(cls, path: str | os.PathLike[str], cluster: SessionHost) -> Session:
        """Continue a session saved with ``save`` (see ``AsyncSession.load``); the same as
        ``cluster.load_session(path)``.

        >>> with Session.load("run.json", cluster) as s:  # doctest: +SKIP
        ...     print(s.send("Where were we?").text)
        """
        return cluster.load_session(path)

    turn = _blocking(AsyncSession.turn)
    send = _blocking(AsyncSession.send)
    stream = _iterating(AsyncSession.stream)
    extend_handle = _blocking(AsyncSession.extend_handle)
    offload = _blocking(AsyncSession.offload)
    persist = _blocking(AsyncSession.persist)
    unpin = _blocking(AsyncSession.unpin)
    tool_wait = _holding(AsyncSession.tool_wait)
    fork = _on_loop(AsyncSession.fork)

    def close(self) -> None:
        """Close the session: forget its handle and free its place on the pair."""
        if self._pool.closed:
            self._state.close()  # the loop thread is gone; so is everything it held
            self._state.apply(kv.detached(self._state.kv))
        elif not self._state.closed:
            self._portal.call(self._inner.aclose())

    def detach(self) -> None:
        """Close this copy without releasing its handle (see ``AsyncSession.detach``)."""
        if self._pool.closed:
            self._state.close()  # the loop thread is gone; so is everything it held
            self._state.apply(kv.detached(self._state.kv))
        elif not self._state.closed:

            async def _detach() -> None:
                self._inner.detach()

            self._portal.call(_detach())

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
