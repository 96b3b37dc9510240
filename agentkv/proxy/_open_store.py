"""The store a ``--state`` URL names: the one place that knows the implementations.

The interface (``_store``) knows none of them, so an implementation importing it makes no circle,
and a store's client library (``redis``) is imported only when a URL asks for it.
"""

from __future__ import annotations

from agentkv.proxy._store import SessionStore

__all__ = ["open_store"]


def open_store(url: str, *, lease_s: float) -> SessionStore:
    """The store a ``--state`` URL names (``redis://``: needs ``pip install 'agentkv[redis]'``)."""
    try:
        from agentkv.proxy._redis_store import RedisSessions
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        from agentkv._core import ConfigError

        raise ConfigError(
            "--state redis://... needs the redis client: pip install 'agentkv[redis]'"
        ) from exc
    return RedisSessions.from_url(url, lease_s=lease_s)
