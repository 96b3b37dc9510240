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

A claim also says whether a claim on the session ended without a commit or a release since the
last commit (``Claim.dirty``): its holder died or lost its lease mid-turn, and that turn may have
consumed the stored snapshot's decode handle. The mark is sticky: only a commit clears it (a
release, or an idle sweep's refused removal, by a holder that found it set leaves it set), since
only a commit replaces the handle it is about. After a clean handover the snapshot's handle is
exactly as the turn that stored it left it, and is attached at once.

Each claim may record the request secret its turn's D leg is sent with (``claim(secret=...)``,
the ``X-Request-Id`` tag decode pins that turn's KV under). A claim that ended without a commit
leaves its secret behind as an *orphan*: the KV its turn may have pinned on decode is referenced
by no stored snapshot, and the next claim gets the orphans (``Claim.orphans``) to release them
by their tags, instead of leaving them pinned for decode's whole TTL. A holder whose commit
failed without an answer (the store unreachable) learns later whether it landed
(``fence_off``), and releases its own turn's pin only when it is certain it did not.

``RedisSessions`` (``_redis_store``) is the implementation; without ``--state`` the proxy keeps
sessions in its own memory and uses no store at all.

A commit may append: a turn adds a few hundred token ids to a transcript of thousands, so the
caller names the part of the snapshot that only grows (``tail``) and how much of it the claimed
version already stores (``kept``); the store then receives the rest of the snapshot and the new
ids only. Readers never see the difference: what a claim or a peek returns is the committed
snapshot byte for byte.

The store also keeps the Responses API's stored responses (``_responses_store``): small records
grouped by session (``response_group``), so that any replica continues a response any other
made, and they go when their session is removed.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Protocol

from agentkv._core import AgentKVError

__all__ = [
    "Claim",
    "ClaimLostError",
    "CommitFate",
    "SessionStore",
    "StoreUnavailableError",
    "Stored",
    "response_group",
]


def response_group(key: str) -> str:
    """The name of a session's group of stored responses (a digest of its store key, which a
    response id carries: finding a response needs no other lookup)."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


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
    ``dirty``: a claim since the last commit ended without a commit or release (see the module
    docstring), so that no copy of the session is used as if nothing had happened since.
    ``secret`` the request secret this claim recorded for its turn's D leg; ``orphans`` those
    of earlier claims that ended without a commit (their turns' pins, if any, are the new
    holder's to release).
    """

    key: str
    fence: int
    version: int
    data: bytes | None = None
    dirty: bool = False
    secret: str = field(default="", repr=False)
    orphans: tuple[str, ...] = field(default=(), repr=False)


class CommitFate(enum.Enum):
    """What became of a commit whose answer was lost (``SessionStore.fence_off``)."""

    LANDED = "landed"
    """The store holds it: the turn's handle is the stored one."""
    LOST = "lost"
    """It never landed, and now never will (the claim is fenced off): the turn's pin is
    referenced by nothing, and its holder releases it."""
    SUPERSEDED = "superseded"
    """Another claim came since: whichever way it went, the pin is not this holder's to touch
    (a later holder found the claim unfinished and got its secret as an orphan, or attached
    the handle the commit stored)."""


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

    async def claim(
        self, key: str, *, known_version: int, wait_s: float, secret: str = ""
    ) -> Claim:
        """Claim ``key``, waiting up to ``wait_s`` for another holder; ``TimeoutError`` then.

        ``Claim.data`` is the stored snapshot when ``known_version`` is not its version, or
        when the claim is ``dirty``. ``secret``: the request secret of the D leg this claim's
        turn sends (none for a claim that sends no turn); kept until the claim commits or is
        released, an orphan for the next claim otherwise."""
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
        left the session as it found it: the next claim is then ``dirty`` only if this one was,
        and gets this one's orphans (its own secret is dropped: its turn pinned nothing)."""
        ...

    async def fence_off(self, claim: Claim) -> CommitFate:
        """After a commit whose answer was lost: whether it landed, and when it did not, make
        sure it never will (the claim is released, the session left ``dirty``)."""
        ...

    async def remove(self, claim: Claim, *, idle_before: float | None = None) -> bool:
        """Delete the session (and its responses) and release the claim; ``True`` only for the
        one caller that deleted a stored snapshot. With ``idle_before`` (wall-clock seconds),
        only a session last used before then is deleted (an idle sweep that raced a request
        loses)."""
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

    async def put_response(
        self, key: str, response_id: str, record: bytes, *, count: int, ttl_s: float
    ) -> None:
        """Keep ``record`` as response ``response_id`` of session ``key``, in the session's
        group (``response_group``); ``count``: how many of the session's messages its history
        is. The group lives until the session is removed, or ``ttl_s`` after its latest put."""
        ...

    async def get_response(self, group: str, response_id: str) -> bytes | None:
        """The record of response ``response_id`` in ``group``; ``None`` when it is gone."""
        ...

    async def drop_responses(self, key: str, *, after: int) -> None:
        """Drop session ``key``'s responses whose history is longer than ``after`` messages (a
        fork kept that many)."""
        ...

    async def shared_secret(self) -> str:
        """A random secret every replica of this store gets alike (made by the first to ask):
        the proxy's cache-salt key when none is configured."""
        ...

    async def ping(self) -> bool: ...

    async def aclose(self) -> None: ...
