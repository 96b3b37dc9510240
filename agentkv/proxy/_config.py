"""The proxy's settings, in one typed object, and the API-key file.

The CLI maps its flags onto ``ProxyConfig``; nothing below the CLI reads the environment.

>>> ProxyConfig(max_sessions=100).session_idle_timeout_s
600.0
>>> keys = ApiKeys.parse("alice sk-alice\\n# a comment\\nsk-anonymous\\n")
>>> keys.principal("sk-alice"), keys.principal("sk-nobody") is None
('alice', True)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from agentkv._core import ConfigError

__all__ = ["ApiKeys", "ProxyConfig", "key_digest"]


def key_digest(key: str) -> str:
    """A short, stable, non-reversible name for an API key (never log or store the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True, slots=True)
class ApiKeys:
    """The accepted API keys, each mapped to the principal that scopes its sessions.

    Keys are held as SHA-256 digests: a lookup hashes the presented key, so comparing it does
    not leak a stored key through timing, and a memory dump does not reveal one.
    """

    by_digest: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, *, source: str = "api keys") -> ApiKeys:
        """One key a line, optionally after a name (``alice sk-...``); ``#`` starts a comment.

        A key without a name is known by its digest.
        """
        by_digest: dict[str, str] = {}
        names: set[str] = set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) > 2:
                raise ConfigError(f"{source}:{number}: expected 'KEY' or 'NAME KEY'")
            key = fields[-1]
            digest = hashlib.sha256(key.encode()).hexdigest()
            name = fields[0] if len(fields) == 2 else f"key-{digest[:16]}"
            if digest in by_digest:
                raise ConfigError(f"{source}:{number}: duplicate key")
            if name in names:
                raise ConfigError(f"{source}:{number}: duplicate name {name!r}")
            names.add(name)
            by_digest[digest] = name
        if not by_digest:
            raise ConfigError(f"{source}: no API keys (an empty file would lock every client out)")
        return cls(by_digest=MappingProxyType(by_digest))

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {path}: {exc}") from exc
        return cls.parse(text, source=str(path))

    def principal(self, key: str) -> str | None:
        """The principal a presented key belongs to, or ``None`` for an unknown key."""
        return self.by_digest.get(hashlib.sha256(key.encode()).hexdigest())


@dataclass(frozen=True, kw_only=True, slots=True)
class ProxyConfig:
    """How ``agentkv proxy`` serves.

    Attributes:
        host, port: where to listen.
        api_keys: accepted keys; ``None`` accepts any request (sessions are still scoped by the
            presented key, so two clients never share a session by accident).
        session_idle_timeout_s: a session unused this long is closed (its handle dropped). Longer
            than the decode server's pin TTL (480 s) keeps the token-exact transcript, so prefill's
            own prefix cache can still serve the history after the pin is gone.
        max_sessions: open sessions at most; past it the session idle the longest is closed.
        max_body_bytes: larger request bodies get 413 before they are parsed.
        default_max_tokens: the generation limit of requests that set none.
        sweep_interval_s: how often idle sessions are looked for.
        tool_calling: ``auto`` (probe the backend once for a tool parser), ``native`` (the
            backend parses tool calls) or ``json`` (agentkv's structured-output protocol).
        state: where sessions live: ``None`` in this process's memory; ``redis://HOST:PORT/DB``
            in Redis, shared by every replica that names it (any replica serves any session).
        state_lease_s: how long a replica's claim on a session holds without renewal (it renews
            every third of it while a turn runs); a crashed replica's claims free after it.
        isolate_prefix_caches: give every principal (API key) its own vLLM ``cache_salt``, so
            no one's requests hit another's prefix cache (a timing side channel: a fast first
            token says someone sent that prefix). Off shares cached prefixes, such as a common
            system prompt, across keys.
        cache_salt_secret: the key the salts are derived with (HMAC-SHA256 of the principal).
            ``None`` draws one per process; replicas that should share each principal's prefix
            cache set the same secret.
        metrics_need_key: ``GET /metrics`` asks for an API key like the API routes (only with
            ``api_keys``).
        persist_idle_s: a session unused this long has its pinned turn-end KV persisted to
            decode's file tier (where decode has one), freeing decode's memory while it waits;
            the next turn loads it back from the tier. ``None`` keeps the pin until it expires.
            Two minutes: past any think time a pin is meant for, far below the pin's 480 s TTL.
            In-memory sessions only (a shared store's sessions keep their pins).
        allow_client_persist: honour a client's ``X-AgentKV-Persist: disk`` (a tier write on
            decode that every tenant waits behind); off by default: the header is ignored and
            the answer says so (``X-AgentKV-Persist-Ignored``). See ``_persist_gate``.
        client_persist_per_minute: with ``allow_client_persist``, the persists one principal
            may ask for a minute (a burst of as many, then that rate; per proxy replica).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: ApiKeys | None = None
    session_idle_timeout_s: float = 600.0
    max_sessions: int = 10_000
    max_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = 1024
    sweep_interval_s: float = 15.0
    tool_calling: str = "auto"
    state: str | None = None
    state_lease_s: float = 30.0
    isolate_prefix_caches: bool = True
    cache_salt_secret: str | None = field(default=None, repr=False)
    metrics_need_key: bool = False
    persist_idle_s: float | None = 120.0
    allow_client_persist: bool = False
    client_persist_per_minute: float = 6.0

    def __post_init__(self) -> None:
        if not (
            math.isfinite(self.client_persist_per_minute) and self.client_persist_per_minute >= 1
        ):
            raise ConfigError("client_persist_per_minute must be a finite number, at least 1")
        if self.persist_idle_s is not None and not (
            math.isfinite(self.persist_idle_s) and self.persist_idle_s > 0
        ):
            raise ConfigError("persist_idle_s must be positive (or None: never)")
        if self.state is not None and not self.state.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(f"state must be a redis:// URL, got {self.state!r}")
        if self.state_lease_s <= 0:
            raise ConfigError("state_lease_s must be positive")
        if self.metrics_need_key and self.api_keys is None:
            raise ConfigError("metrics_need_key needs api_keys (--api-keys)")
        if self.tool_calling not in ("auto", "native", "json"):
            raise ConfigError("tool_calling must be auto, native or json")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.session_idle_timeout_s <= 0:
            raise ConfigError("session_idle_timeout_s must be positive")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens must be at least 1")
        if self.sweep_interval_s <= 0:
            raise ConfigError("sweep_interval_s must be positive")
