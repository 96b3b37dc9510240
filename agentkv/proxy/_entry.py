"""One session as the proxy keeps it (``SessionEntry``), and its key in a shared store."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

from agentkv._core import AsyncCluster, AsyncSession, Message, dumps, loads
from agentkv.proxy._store import Claim

__all__ = ["Key", "SessionEntry", "split_key", "store_key"]

Key = tuple[str, str]


class SessionEntry:
    """One open session and the proxy's bookkeeping around it.

    Which of its messages the model generated, what the client was shown for them and the tools
    its prefix was rendered with are the session's own (``AsyncSession.sync_history``).
    """

    __slots__ = (
        "claim",
        "closed",
        "created_at",
        "forks",
        "key",
        "last_used",
        "lock",
        "offload_tried",
        "renewer",
        "session",
        "store_s",
        "stored_ids",
        "users",
        "version",
        "write",
    )

    def __init__(self, key: Key, session: AsyncSession, *, now: float) -> None:
        self.key = key
        self.session = session
        self.lock = asyncio.Lock()
        self.users = 0
        self.last_used = now
        self.created_at = time.time()
        self.forks = 0
        self.closed = False
        # The idle sweep tried to offload this session's pin (reset when a request uses it).
        self.offload_tried = False
        # With a shared store: the stored version this copy is, the claim held while checked out.
        self.version = 0
        self.claim: Claim | None = None
        self.renewer: asyncio.Task[None] | None = None
        # The checkin writing this entry's commit behind its answer (shared store only).
        self.write: asyncio.Task[None] | None = None
        # The token ids the shared store holds as the tail of one version (see ``stored``).
        self.stored_ids: tuple[int, bytes] | None = None
        # Seconds the request holding this entry waited on the shared store (the claim, with the
        # restore when the copy was stale; the commit comes after the answer): the proxy reports
        # it in ``Server-Timing: store``.
        self.store_s = 0.0

    @property
    def session_id(self) -> str:
        return self.key[1]

    async def stop_renewing(self) -> None:
        """Stop the claim's renewer, if one runs, and wait until it has stopped.

        Not ``await renewer`` under suppress(CancelledError): that also swallowed a
        cancellation of the caller (a write behind an answer cancelled at shutdown went on to
        commit). A renewer that failed (Redis gone) is left to the caller's next store call to
        find; its exception is retrieved here, so it is not logged as never retrieved."""
        renewer, self.renewer = self.renewer, None
        if renewer is None:
            return
        renewer.cancel()
        await asyncio.wait([renewer])
        if not renewer.cancelled():
            renewer.exception()

    def to_bytes(self, *, wall: float) -> bytes:
        """The entry as the shared store keeps it: the mapping's JSON, then the session's
        ``snapshot_bytes`` (the token ids as raw int32, not JSON numbers)."""
        transcript = self.session.transcript
        mapping = dumps(
            {
                # The session's snapshot holds these now; an older replica sharing the store
                # reads them here (``tools_key`` ``None``: it leaves the tools check to the turn).
                "generated": sorted(transcript.generated),
                "views": {str(i): view.to_openai() for i, view in transcript.views.items()},
                "tools_key": None,
                "forks": self.forks,
                "created_at": self.created_at,
            }
        )
        # Fenced: the store's claims hand the session over; this copy stops before another goes.
        session = self.session.snapshot_bytes(wall=wall, fenced=True)
        return b"".join((_MAGIC, _LENGTH.pack(len(mapping)), mapping, session))

    def tail_size(self) -> int:
        """How many bytes ``to_bytes`` ends with that are the transcript's token ids (the part
        that a turn appends to; ``snapshot_bytes`` writes them last, 4 bytes each)."""
        return _ID_SIZE * self.session.transcript.num_tokens

    def stored(self, version: int, data: bytes, *, tail: int | None = None) -> None:
        """Note that the store holds ``data`` as ``version``, ``data`` being this copy's bytes
        (just loaded, or just committed with ``tail``): its token ids are what a later commit
        may extend."""
        tail = self.tail_size() if tail is None else tail
        self.stored_ids = (version, data[len(data) - tail :]) if tail else None

    def split(self, version: int, data: bytes) -> tuple[int, int]:
        """``SessionStore.commit``'s ``tail`` and ``kept`` for ``data``, this copy's ``to_bytes``,
        on a claim of ``version``: the token ids are the tail, and the store holds the ones that
        ``stored`` noted for ``version`` when the new ids start with them. ``kept`` is 0 when
        nothing is noted for ``version`` or the new ids do not extend it (a fork, a truncation,
        another session under the key): the commit then writes the snapshot whole.

        Why an append stores ``data`` exactly: versions never repeat, the noted ids are the last
        bytes of what was stored as ``version``, and the store's script appends only when its
        tail is of ``version`` and as long as the noted ids, so it holds those very bytes."""
        tail = self.tail_size()
        noted = self.stored_ids
        if noted is None or noted[0] != version or version <= 0 or len(noted[1]) > tail:
            return tail, 0
        ids = noted[1]
        # startswith at an offset: one memcmp (comparing memoryviews goes element by element).
        if not data.startswith(ids, len(data) - tail):
            return tail, 0
        return tail, len(ids)

    def load_bytes(
        self, data: bytes, cluster: AsyncCluster, *, confirmed: bool = False,
        drop_handle: str | None = None,
    ) -> None:
        """Replace this copy with the stored one (the old copy is detached, its pin kept).

        ``confirmed``: the stored handle is attached without asking decode first (a clean
        claim: see ``Claim.dirty``); ``drop_handle``, a reason: it is not attached at all (a
        dirty one; see ``AsyncCluster.restore_session``). An entry stored as one JSON document,
        by an agentkv before ``to_bytes`` wrote this form, loads too (replicas of both can share
        a store while they are upgraded)."""
        if data.startswith(_MAGIC):
            start = len(_MAGIC) + _LENGTH.size
            (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
            stored: dict[str, Any] = loads(data[start : start + length])
            snapshot: bytes | dict[str, Any] = data[start + length :]
        else:
            stored = loads(data)
            snapshot = stored["session"]
        session = cluster.restore_session(snapshot, confirmed=confirmed, drop_handle=drop_handle)
        try:
            # An entry of an older agentkv kept these beside a snapshot without them.
            session.mark_generated(
                stored["generated"],
                views={int(i): Message.from_openai(v) for i, v in stored["views"].items()},
            )
        except BaseException:
            session.detach()
            raise
        self.session.detach()
        self.session = session
        self.forks = stored["forks"]
        self.created_at = stored["created_at"]


_MAGIC = b"agentkv.entry.bin\x00"
_LENGTH = struct.Struct(">I")
_ID_SIZE = 4  # snapshot_bytes: a token id is a C int, 4 bytes on every platform agentkv runs on


def store_key(principal: str, session_id: str) -> str:
    """The shared store's key of a session: unambiguous whatever either part contains."""
    return f"{len(principal)}:{principal}:{session_id}"


def split_key(key: str) -> tuple[str, str]:
    length, _, rest = key.partition(":")
    n = int(length)
    return rest[:n], rest[n + 1 :]
