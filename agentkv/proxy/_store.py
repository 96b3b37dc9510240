"""Shared session state: the interface proxy replicas use to hand sessions to each other.

A session's state (its snapshot: the token-exact transcript, the message mapping, the decode
handle with its lease secret, the stats) lives in a store every replica reaches. A replica that
serves a request for a session first *claims* it: a lock with a lease, and a fencing token that
grows with every claim anywhere. While it holds the claim no other replica can claim the session;
its writes (``commit``, ``remove``) succeed only while the store still holds that very token, so a
holder whose lease ran out (a replica paused, partitioned, or slow past the lease) can never
overwrite what the next holder wrote.

The snapshot's version is the fencing token that committed it: versions never repeat, even
across a delete and a new session under the same id, so a replica's cached copy is reused only
when it is exactly the stored one (``Claim.data`` is ``None`` then, and nothing is transferred).

A claim also says whether the previous one on the session ended without a commit or a release
(``Claim.dirty``): its holder died or lost its lease mid-turn, and that turn may have consumed
the stored snapshot's decode handle. Only then must the next holder confirm the handle with
decode before attaching it; after a clean handover the snapshot's handle is exactly as the
turn that stored it left it, and is attached at once.

``RedisSessions`` (``_redis_store``) is the implementation; without ``--state`` the proxy keeps
sessions in its own memory and uses no store at all.

A commit may append: a turn adds a few hundred token ids to a transcript of thousands, so the
caller names the part of the snapshot that only grows (``tail``) and how much of it the claimed
version already stores (``kept``); the store then receives the rest of the snapshot and the new
ids only. Readers never see the difference: what a claim or a peek returns is the committed
snapshot byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from agentkv._core import AgentKVError

__all__ = ["Claim", "ClaimLostError", "SessionStore", "StoreUnavailableError", "Stored"]


class ClaimLostError(AgentKVError):
    """The store no longer holds this claim's fencing token: another replica took the session
    (the lease ran out) or it was deleted. Whatever this holder meant to write is refused."""


class StoreUnavailableError(AgentKVError):
    """The store could not be reached (connection refused, reset or timed out)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """A held claim on one session.

    ``fence`` is the fencing token; ``version`` the stored snapshot's version (0: none stored);
    ``data`` the snapshot when it differs from the version the claimant said it holds, or when
    ``dirty``: the previous claim ended without a commit or release (see the module docstring),
    so that no copy of the session is used as if nothing had happened since.
    """

    key: str
    fence: int
    version: int
    data: bytes | None = None
    dirty: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Stored:
    """What :meth:`SessionStore.peek` saw: the stored version and snapshot (``0`` and ``None``
    when none is stored), and whether some replica holds a claim on the session right now."""

    version: int
    data: bytes | None
    claimed: bool


class SessionStore(Protocol):
    """Where replicas keep sessions (see the module docstring for the guarantees)."""

    lease_s: float
    """How long a claim holds without ``renew`` (holders renew every third of it)."""

    async def claim(self, key: str, *, known_version: int, wait_s: float) -> Claim:
        """Claim ``key``, waiting up to ``wait_s`` for another holder; ``TimeoutError`` then.

        ``Claim.data`` is the stored snapshot when ``known_version`` is not its version, or
        when the claim is ``dirty``."""
        ...

    async def renew(self, claim: Claim) -> bool:
        """Extend the claim's lease; ``False`` when it was lost."""
        ...

    async def commit(
        self,
        claim: Claim,
        data: bytes,
        *,
        used_at: float,
        pinned: bool = False,
        tail: int = 0,
        kept: int = 0,
    ) -> int:
        """Store ``data`` and release the claim; returns the new version. ``used_at`` is the
        session's last use (wall-clock seconds); ``pinned`` says it holds turn-end KV pinned on
        decode (listed by ``pinned_idle`` until a commit says otherwise).

        ``tail``: how many bytes at the end of ``data`` only grow from turn to turn (the token
        ids), kept apart so that a later commit can append to them. ``kept``: how many leading
        bytes of that tail the caller knows the store holds as the tail of ``claim.version``;
        only the rest is sent. When the store's tail is not exactly those (another layout, a
        version written whole), ``data`` is written whole. Whichever way, a claim or a peek
        gets ``data`` byte for byte.

        Raises ``ClaimLostError`` (and stores nothing) when the claim was lost.
        """
        ...

    async def release(self, claim: Claim) -> None:
        """Release the claim without writing (a no-op when it was lost). Only for a holder that
        left the session as it found it: the next claim is then not ``dirty``."""
        ...

    async def remove(self, claim: Claim, *, idle_before: float | None = None) -> bool:
        """Delete the session and release the claim; ``True`` only for the one caller that
        deleted a stored snapshot. With ``idle_before`` (wall-clock seconds), only a session
        last used before then is deleted (an idle sweep that raced a request loses)."""
        ...

    async def peek(self, key: str) -> Stored:
        """The stored version and snapshot, without claiming."""
        ...

    async def idle(self, *, before: float, limit: int) -> list[str]:
        """Keys of sessions last used before ``before`` (wall-clock seconds)."""
        ...

    async def take_idle(self, *, before: float, limit: int, hold_s: float) -> list[str]:
        """Up to ``limit`` keys of sessions last used before ``before``, each handed to one
        caller: a key taken is not taken again for ``hold_s`` seconds (the idle sweep of
        several replicas shares the work this way instead of racing for the same keys)."""
        ...

    async def count(self) -> int:
        """How many sessions are stored (committed at least once and not removed)."""
        ...

    async def pinned_idle(self, *, before: float, limit: int) -> list[tuple[str, float]]:
        """Keys and last use of sessions with pinned KV, last used before ``before``."""
        ...

    async def shared_secret(self) -> str:
        """A random secret every replica of this store gets alike (made by the first to ask):
        the proxy's cache-salt key when none is configured."""
        ...

    async def ping(self) -> bool: ...

    async def aclose(self) -> None: ...
