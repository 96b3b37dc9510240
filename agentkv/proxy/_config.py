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
import inspect
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agentkv._core import ConfigError
from agentkv.proxy._messages_system import DEFAULT_DROPS

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
        max_sessions: open sessions at most (each replica's copies, with ``state``); past it
            an idle one is closed, taken from the principals holding the most (``_fair``).
        max_sessions_per_key: open sessions one principal may hold at most (``None``: no cap
            beyond its fair share of ``max_sessions`` once the registry is full).
        max_stored_sessions: with ``state``, sessions the store holds at most, all replicas
            together: a new session past it gets 503 (``None``: ``max_sessions``).
        max_body_bytes: larger request bodies get 413 before they are parsed.
        body_timeout_s: a request body may pause this long between two pieces, and has this
            long plus a second per ``body_min_rate`` bytes received to arrive whole; past either,
            408 and the connection is closed (``_deadline`` says why both). Ten seconds: far
            past a healthy client's pauses (TCP retransmits), short enough that clients stalled
            mid-upload free their memory and connections quickly. ``None``: no deadline (only
            behind a front proxy that has one).
        body_min_rate: bytes a second that earn a slow upload more time: a steady upload at this
            rate is never cut, and no body holds a connection longer than ``body_timeout_s +
            max_body_bytes / body_min_rate`` (138 s by default). 64 KiB/s is a 512 kbit/s
            uplink. ``None``: the whole body within ``body_timeout_s``.
        header_timeout_s: a connection must complete a request's headers within this many
            seconds of connecting (or of its first byte after a response), else it is closed;
            uvicorn has none (``_header_deadline``), so clients stalled in their headers
            (slowloris) would hold their connections, and ``max_connections``, as long as they
            liked. ``None``: no deadline (only behind a front proxy that has one).
        max_connections: uvicorn's ``limit_concurrency``: a request that arrives while this many
            client connections are open (its own included) or this many requests are in flight
            gets uvicorn's plain 503, and its connection is closed. Bounds what clients can hold
            together (about ``max_body_bytes`` each while uploading); below the usual
            1,024-descriptor limit, past which accepting fails instead. ``None``: no limit.
        default_max_tokens: the generation limit of requests that set none.
        refuse_oversized_max_tokens: a request's ``max_tokens`` (``max_completion_tokens``,
            ``max_output_tokens``) above what its prompt leaves of the model's context is
            refused (400 ``context_length_exceeded``) instead of clamped to it (the default:
            agents ask for 32000 whatever the model).
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
        offload_idle_s: a session unused this long has its pinned turn-end KV offloaded to
            decode's file tier (where decode has one), freeing decode's memory while it waits;
            the next turn loads it back from the tier. ``None`` keeps the pin until it expires.
            Two minutes: past any think time a pin is meant for, far below the pin's 480 s TTL.
            In-memory sessions only (a shared store's sessions keep their pins).
        relieve_kv_usage: a decode's ``vllm:kv_cache_usage_perc`` at or above which the pins of
            idle sessions on it are freed, the longest idle first, until it is below
            ``relieve_kv_usage - relieve_margin`` (offloaded to its file tier, else released:
            ``_relief``); ``None`` never. Read every ``relieve_interval_s`` from each decode's
            ``/metrics``. 0.9: the SDK's tool waits offload at the same usage
            (``CachePolicy.persist_kv_usage``).
        responses_max_bytes: what the stored responses of ``POST /v1/responses`` (what
            ``previous_response_id`` continues) may hold in this process's memory; past it the
            oldest go first. Each is a reference into its session, about 450 bytes whatever the
            conversation's length: the default keeps about 150,000. With ``state`` they live in
            the shared store instead, each session's until it is removed.
        allow_client_offload: honour a client's ``X-AgentKV-Offload: always`` (a tier write on
            decode that every tenant shares); off by default: the header is ignored and the
            answer says so (``X-AgentKV-Offload-Ignored``). See ``_offload_gate``.
        drop_system_blocks: regular expressions; a Messages API system block (or ``role:
            "system"`` message) one of them matches is left out before rendering: lines that
            differ per session or request would keep every session's prefix apart. Default:
            Claude Code's ``x-anthropic-billing-header`` line (``_messages_system``).
        client_offload_per_minute: with ``allow_client_offload``, the offloads one principal
            may ask for a minute (a burst of as many, then that rate; per proxy replica).

    The fields' names before issue 41 (``persist_idle_s``, ``allow_client_persist``,
    ``client_persist_per_minute``) are still accepted as keywords and read as attributes, with a
    DeprecationWarning, for one release.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: ApiKeys | None = None
    session_idle_timeout_s: float = 600.0
    max_sessions: int = 10_000
    max_sessions_per_key: int | None = None
    max_stored_sessions: int | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float | None = 10.0
    body_min_rate: int | None = 64 * 1024
    header_timeout_s: float | None = 10.0
    max_connections: int | None = 1000
    default_max_tokens: int = 1024
    refuse_oversized_max_tokens: bool = False
    sweep_interval_s: float = 15.0
    tool_calling: str = "auto"
    state: str | None = None
    state_lease_s: float = 30.0
    isolate_prefix_caches: bool = True
    cache_salt_secret: str | None = field(default=None, repr=False)
    metrics_need_key: bool = False
    offload_idle_s: float | None = 120.0
    relieve_kv_usage: float | None = 0.9
    relieve_margin: float = 0.1
    relieve_interval_s: float = 2.0
    allow_client_offload: bool = False
    client_offload_per_minute: float = 6.0
    responses_max_bytes: int = 64 * 1024 * 1024
    drop_system_blocks: tuple[str, ...] = DEFAULT_DROPS

    def _check_serving(self) -> None:
        if not (
            math.isfinite(self.client_offload_per_minute) and self.client_offload_per_minute >= 1
        ):
            raise ConfigError("client_offload_per_minute must be a finite number, at least 1")
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

    def _check_relief(self) -> None:
        if self.relieve_kv_usage is not None and not (
            0 < self.relieve_kv_usage - self.relieve_margin < self.relieve_kv_usage <= 1
        ):
            raise ConfigError(
                "relieve_kv_usage must be in (relieve_margin, 1] (or None: never), got "
                f"{self.relieve_kv_usage}"
            )
        if not (math.isfinite(self.relieve_interval_s) and self.relieve_interval_s > 0):
            raise ConfigError("relieve_interval_s must be positive")

    def __post_init__(self) -> None:
        if self.offload_idle_s is not None and not (
            math.isfinite(self.offload_idle_s) and self.offload_idle_s > 0
        ):
            raise ConfigError("offload_idle_s must be positive (or None: never)")
        self._check_relief()
        self._check_serving()
        if self.session_idle_timeout_s <= 0:
            raise ConfigError("session_idle_timeout_s must be positive")
        for name in ("max_sessions", "max_sessions_per_key", "max_stored_sessions"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        self._check_client_limits()
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens must be at least 1")
        if self.responses_max_bytes < 0:
            raise ConfigError("responses_max_bytes must not be negative (0: store none)")
        if self.sweep_interval_s <= 0:
            raise ConfigError("sweep_interval_s must be positive")
        for pattern in self.drop_system_blocks:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"drop_system_blocks: bad pattern {pattern!r}: {exc}") from None

    def _check_client_limits(self) -> None:
        if self.body_timeout_s is not None and not (
            math.isfinite(self.body_timeout_s) and self.body_timeout_s > 0
        ):
            raise ConfigError("body_timeout_s must be positive (or None: no deadline)")
        if self.header_timeout_s is not None and not (
            math.isfinite(self.header_timeout_s) and self.header_timeout_s > 0
        ):
            raise ConfigError("header_timeout_s must be positive (or None: no deadline)")
        if self.body_min_rate is not None and self.body_min_rate < 1:
            raise ConfigError("body_min_rate must be at least 1 byte/s (or None: no rate)")
        if self.max_connections is not None and self.max_connections < 2:
            # uvicorn counts the asking connection: one would refuse every request.
            raise ConfigError("max_connections must be at least 2 (or None: no limit)")


# The fields' names before issue 41 ("persist" meant three things; these are the file tier's
# offload). Accepted for one release, with a DeprecationWarning.
_RENAMED_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "persist_idle_s": "offload_idle_s",
        "allow_client_persist": "allow_client_offload",
        "client_persist_per_minute": "client_offload_per_minute",
    }
)


def _warn_renamed(old: str) -> None:
    warnings.warn(
        f"ProxyConfig.{old} is deprecated; use {_RENAMED_FIELDS[old]}",
        DeprecationWarning,
        stacklevel=3,
    )


def _with_old_keywords(init: Any) -> Any:
    def __init__(self: ProxyConfig, **kwargs: Any) -> None:  # noqa: N807 - it is the __init__
        for old, new in _RENAMED_FIELDS.items():
            if old in kwargs:
                _warn_renamed(old)
                if new in kwargs:
                    raise TypeError(f"ProxyConfig got both {old} and {new}")
                kwargs[new] = kwargs.pop(old)
        init(self, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    return __init__


def _old_attribute(old: str) -> property:
    def read(self: ProxyConfig) -> Any:
        _warn_renamed(old)
        return getattr(self, _RENAMED_FIELDS[old])

    return property(read, doc=f"Deprecated: {_RENAMED_FIELDS[old]}.")


ProxyConfig.__init__ = _with_old_keywords(ProxyConfig.__init__)  # type: ignore[method-assign]
for _old in _RENAMED_FIELDS:
    setattr(ProxyConfig, _old, _old_attribute(_old))
