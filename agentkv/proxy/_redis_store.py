"""``SessionStore`` on Redis (or Valkey), through the ``redis`` library's asyncio client.

Keys (``prefix`` defaults to ``agentkv:``):

* ``{prefix}s:{key}``: a hash, ``snap`` (the snapshot bytes without their tail), ``ver`` (its
  version), ``tver`` (the version whose tail ``{prefix}t:{key}`` holds); while a claim is open,
  ``held`` (its fence) and ``secret`` (its D leg's request secret); and, from a claim that finds
  ``held`` set (the last claim never committed or released) until the next commit, ``dirty``
  (``Claim.dirty``) and ``orphans``, the secrets of the claims that ended so, at most
  ``ORPHANS_KEPT``. A session nothing was committed for yet has only the claim's fields, with an
  expiry (``UNCOMMITTED_TTL_S``) that its first commit removes.
* ``{prefix}t:{key}``: a string, the snapshot's tail (its token ids: see ``SessionStore.commit``),
  appended to (``APPEND``) by a commit that extends it, replaced (``SET``) by any other. The
  snapshot is ``snap`` followed by it when ``tver`` is ``ver``; when it is not (the hash was
  written by an agentkv that stored snapshots whole), ``snap`` alone.
* ``{prefix}l:{key}``: the lock, holding the fencing token, with a ``PX`` lease.
* ``{prefix}fence``: the fencing counter (``INCR``), shared by every session.
* ``{prefix}idle``: a sorted set, session key -> last use (wall-clock milliseconds).
* ``{prefix}pinned``: the same, for the sessions whose turn-end KV is pinned on decode (a
  candidate for the file tier once idle).
* ``{prefix}r:{group}``: a hash, a session's stored responses (``response_group`` of its key):
  response id -> ``COUNT:RECORD`` (``COUNT``: how many of the session's messages the response's
  history is, what a fork's ``drop_responses`` compares). Removing the session deletes it; a
  ``PX`` of ``ttl_s``, renewed by every put, reclaims one whose session never got stored.
* ``{prefix}sweeping``: a sorted set, session key -> until when (wall-clock milliseconds) an
  idle sweep holds it (``take_idle``): no other sweep takes it before then.

Every operation is one Lua script, so one round trip and atomic: claiming (lock, fence, and the
snapshot when the caller's copy is stale), committing (fence check, write, unlock, idle index),
renewing, releasing, removing and peeking. A reader therefore never sees the head of one version
with the tail of another: both are written by one script, and read by one. An appending commit
checks, in its script, that the stored tail is the one it extends (``ver`` and ``tver`` are the
claimed version, the tail is ``kept`` bytes long); when it is not, it writes nothing and the
commit is sent again whole (a second round trip, only for a hash an older agentkv wrote).
An older agentkv that reads a session stored this way gets ``snap`` alone and refuses it as
corrupt (its token ids are missing): replicas sharing a store are upgraded past this together.
A turn costs two round trips, ``claim`` and ``commit``, and the answer waits only for the first
(the proxy commits after answering).
The multi-key scripts need every key on one node: a single Redis or a primary with replicas,
not Redis Cluster.

>>> store = RedisSessions.from_url("redis://127.0.0.1:6379/0")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from agentkv.proxy._store import (
    Claim,
    ClaimLostError,
    CommitFate,
    Stored,
    StoreUnavailableError,
    response_group,
)

__all__ = ["RedisSessions"]

_CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, redis.call('PTTL', KEYS[2])} end
local fence = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[2], fence, 'PX', ARGV[1])
local stored = redis.call('HMGET', KEYS[1], 'ver', 'tver', 'held', 'secret', 'dirty', 'orphans')
local ver = tonumber(stored[1] or '0')
local orphans = stored[6] or ''
if stored[3] then
  -- The last claim ended without a commit or a release: what its turn pinned is an orphan.
  if stored[4] and stored[4] ~= '' then
    local items = {}
    for item in string.gmatch(orphans .. ' ' .. stored[4], '%S+') do items[#items + 1] = item end
    orphans = table.concat(items, ' ', math.max(1, #items - tonumber(ARGV[4]) + 1), #items)
  end
end
local dirty = 0
if ver > 0 and (stored[3] or stored[5]) then dirty = 1 end
redis.call('HSET', KEYS[1], 'held', fence, 'secret', ARGV[3])
if dirty == 1 then redis.call('HSET', KEYS[1], 'dirty', 1) end
if orphans ~= '' then redis.call('HSET', KEYS[1], 'orphans', orphans) end
-- A session nothing was committed for yet: its claim record goes unless a commit keeps it.
if ver == 0 then redis.call('PEXPIRE', KEYS[1], ARGV[5]) end
if ver > 0 and (ver ~= tonumber(ARGV[2]) or dirty == 1) then
  local head = redis.call('HGET', KEYS[1], 'snap')
  if stored[2] == stored[1] then
    return {fence, ver, dirty, orphans, head, redis.call('GET', KEYS[4])}
  end
  return {fence, ver, dirty, orphans, head}
end
return {fence, ver, dirty, orphans}
"""

_COMMIT = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[7] == '0' then
  redis.call('SET', KEYS[5], ARGV[6])
else
  local stored = redis.call('HMGET', KEYS[1], 'ver', 'tver')
  if stored[1] ~= ARGV[8] or stored[2] ~= ARGV[8]
      or redis.call('STRLEN', KEYS[5]) ~= tonumber(ARGV[7]) then
    return -1
  end
  redis.call('APPEND', KEYS[5], ARGV[6])
end
redis.call('HSET', KEYS[1], 'snap', ARGV[2], 'ver', ARGV[1], 'tver', ARGV[1])
redis.call('HDEL', KEYS[1], 'held', 'secret', 'dirty', 'orphans')
redis.call('PERSIST', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[4])
if ARGV[5] == '1' then
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[4])
else
  redis.call('ZREM', KEYS[4], ARGV[4])
end
return tonumber(ARGV[1])
"""

_PEEK = """
local stored = redis.call('HMGET', KEYS[1], 'ver', 'snap', 'tver')
local tail = false
if stored[1] and stored[3] == stored[1] then tail = redis.call('GET', KEYS[3]) end
return {stored[1], stored[2], tail, redis.call('EXISTS', KEYS[2])}
"""

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

# Only a commit clears ``dirty`` and ``orphans``: a release (or a refused removal) says this
# holder changed nothing, not that what an earlier holder left behind is settled.
_RELEASE = """
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
  if redis.call('HGET', KEYS[1], 'held') == ARGV[1] then
    redis.call('HDEL', KEYS[1], 'held', 'secret')
  end
end
return 1
"""

_FENCE_OFF = """
if redis.call('HGET', KEYS[1], 'held') == ARGV[1] then
  if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
  redis.call('HDEL', KEYS[1], 'held', 'secret')
  if redis.call('HEXISTS', KEYS[1], 'ver') == 1 then redis.call('HSET', KEYS[1], 'dirty', 1) end
  return 1
end
if redis.call('HGET', KEYS[1], 'ver') == ARGV[1] then return 2 end
return 0
"""

_REMOVE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
local cutoff = tonumber(ARGV[3])
if cutoff >= 0 then
  local used = redis.call('ZSCORE', KEYS[3], ARGV[2])
  if used and tonumber(used) >= cutoff then
    redis.call('DEL', KEYS[2])
    if redis.call('HGET', KEYS[1], 'held') == ARGV[1] then
      redis.call('HDEL', KEYS[1], 'held', 'secret')
    end
    return 0
  end
end
local existed = redis.call('HEXISTS', KEYS[1], 'ver')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[5], KEYS[6])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
return existed
"""

_PUT_RESPONSE = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

_DROP_RESPONSES = """
local after = tonumber(ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local count = tonumber(string.match(all[i + 1], '^(%d+):'))
  if count == nil or count > after then redis.call('HDEL', KEYS[1], all[i]) end
end
return 1
"""

# KEYS: idle, sweeping. ARGV: cutoff (ms, exclusive), limit, now (ms), hold (ms). Holds past
# their time are dropped first; the candidates read are the page plus every key still held
# (each of those is skipped), so a full page comes back whenever one exists.
_TAKE_IDLE = """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
local limit = tonumber(ARGV[2])
local read = limit + redis.call('ZCARD', KEYS[2])
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1], 'LIMIT', 0, read)
local hold_until = tonumber(ARGV[3]) + tonumber(ARGV[4])
local taken = {}
for _, member in ipairs(members) do
  if #taken >= limit then break end
  if not redis.call('ZSCORE', KEYS[2], member) then
    redis.call('ZADD', KEYS[2], hold_until, member)
    taken[#taken + 1] = member
  end
end
return taken
"""


T = TypeVar("T")

# The orphans a session's hash keeps for the next claim to release (a new one drops the oldest):
# more claims in a row that all die mid-turn are a failing fleet, and a pin left over then
# lives out decode's TTL as it did before.
ORPHANS_KEPT = 8
# How long the claim record of a session nothing was committed for outlives its claim: past
# decode's pin TTL (480 s), after which there is no orphan left to release.
UNCOMMITTED_TTL_S = 900.0
_FATES = {0: CommitFate.SUPERSEDED, 1: CommitFate.LOST, 2: CommitFate.LANDED}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _joined(head: bytes, tail: bytes | None) -> bytes:
    """The snapshot from its stored parts (no tail: one an older agentkv stored whole)."""
    return bytes(head) if tail is None else b"".join((head, tail))


class RedisSessions:
    """Sessions in Redis (see the module docstring).

    Args:
        client: a ``redis.asyncio.Redis`` (the store closes it in ``aclose``).
        lease_s: how long a claim holds without renewal; the proxy renews it every third.
        prefix: prepended to every key, so several deployments can share one Redis.
        poll_s: the longest pause between attempts while another replica holds a session.
        timeout_s: the longest a single Redis call may take (``StoreUnavailableError`` then).

    ``from_url`` turns redis-py's own socket timeout off and bounds each call here instead:
    redis-py enforces its socket timeout on a write with ``asyncio.wait_for``, a task per
    command, about a fifth of the client's CPU per command (``benchmarks/redis_state.py``).
    """

    def __init__(
        self,
        client: Redis,
        *,
        lease_s: float = 30.0,
        prefix: str = "agentkv:",
        poll_s: float = 0.05,
        timeout_s: float = 5.0,
    ) -> None:
        self._redis = client
        self._timeout_s = timeout_s
        self.lease_s = lease_s
        self._lease_ms = max(1, int(lease_s * 1000))
        self._prefix = prefix
        self._poll_s = poll_s
        self._claim = client.register_script(_CLAIM)
        self._commit = client.register_script(_COMMIT)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._remove = client.register_script(_REMOVE)
        self._peek = client.register_script(_PEEK)
        self._fence_off = client.register_script(_FENCE_OFF)
        self._put_response = client.register_script(_PUT_RESPONSE)
        self._drop_responses = client.register_script(_DROP_RESPONSES)
        self._take_idle = client.register_script(_TAKE_IDLE)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisSessions:
        """From ``redis://HOST:PORT/DB`` (any URL ``redis.asyncio.Redis.from_url`` takes)."""
        return cls(Redis.from_url(url, socket_timeout=None), **options)

    async def _call(self, call: Awaitable[T]) -> T:
        """``call``'s result, or ``StoreUnavailableError`` when Redis does not answer within
        ``timeout_s`` or cannot be reached. A cancelled read makes redis-py drop its
        connection, so no answer arriving late is ever read as another command's."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:  # TimeoutError too
            raise StoreUnavailableError(f"the session store is unreachable: {exc!r}") from exc

    def _keys(self, key: str) -> tuple[str, str]:
        return f"{self._prefix}s:{key}", f"{self._prefix}l:{key}"

    def _tail_key(self, key: str) -> str:
        return f"{self._prefix}t:{key}"

    def _responses_key(self, group: str) -> str:
        return f"{self._prefix}r:{group}"

    @property
    def _idle_key(self) -> str:
        return f"{self._prefix}idle"

    @property
    def _pinned_key(self) -> str:
        return f"{self._prefix}pinned"

    async def claim(
        self, key: str, *, known_version: int, wait_s: float, secret: str = ""
    ) -> Claim:
        session, lock = self._keys(key)
        deadline = time.monotonic() + wait_s
        # A commit written behind an answer lands within a round trip: look again soon.
        pause = 0.00025
        while True:
            reply = await self._call(
                self._claim(
                    keys=[session, lock, f"{self._prefix}fence", self._tail_key(key)],
                    args=[
                        self._lease_ms,
                        known_version,
                        secret,
                        ORPHANS_KEPT,
                        int(UNCOMMITTED_TTL_S * 1000),
                    ],
                )
            )
            fence = int(reply[0])
            if fence:
                version, dirty = int(reply[1]), bool(reply[2])
                orphans = _text(reply[3]).split()
                data = None
                if len(reply) > 4:  # no tail: a snapshot an older agentkv stored whole
                    data = _joined(reply[4], reply[5] if len(reply) > 5 else None)
                return Claim(
                    key=key,
                    fence=fence,
                    version=version,
                    data=data,
                    dirty=dirty,
                    secret=secret,
                    orphans=tuple(orphans),
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"session {key} stayed claimed for {wait_s:.1f} s")
            # Held elsewhere: poll with backoff, never past the holder's lease or our deadline.
            lease_left = max(0.001, int(reply[1]) / 1000.0)
            await asyncio.sleep(min(pause, lease_left, left))
            pause = min(pause * 2, self._poll_s)

    async def renew(self, claim: Claim) -> bool:
        _, lock = self._keys(claim.key)
        return bool(await self._call(self._renew(keys=[lock], args=[claim.fence, self._lease_ms])))

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
        if not 0 <= kept <= tail <= len(data):
            raise ValueError(f"commit: kept {kept}, tail {tail} of a {len(data)}-byte snapshot")
        session, lock = self._keys(claim.key)
        keys = [session, lock, self._idle_key, self._pinned_key, self._tail_key(claim.key)]
        view, split = memoryview(data), len(data) - tail
        head, used_ms = view[:split], int(used_at * 1000)
        args: list[EncodableT] = [claim.fence, head, used_ms, claim.key, int(pinned)]
        version = -1
        if kept:  # the new ids only; -1: the stored tail is not the one they extend
            appended = [*args, view[split + kept :], kept, claim.version]
            version = int(await self._call(self._commit(keys=keys, args=appended)))
        if version == -1:
            whole = [*args, view[split:], 0, claim.version]
            version = int(await self._call(self._commit(keys=keys, args=whole)))
        if not version:
            raise ClaimLostError(f"the claim on session {claim.key} was lost; nothing written")
        return version

    async def release(self, claim: Claim) -> None:
        await self._call(self._release(keys=list(self._keys(claim.key)), args=[claim.fence]))

    async def fence_off(self, claim: Claim) -> CommitFate:
        fate = await self._call(
            self._fence_off(keys=list(self._keys(claim.key)), args=[claim.fence])
        )
        return _FATES[int(fate)]

    async def remove(self, claim: Claim, *, idle_before: float | None = None) -> bool:
        session, lock = self._keys(claim.key)
        cutoff = -1 if idle_before is None else int(idle_before * 1000)
        removed = await self._call(
            self._remove(
                keys=[
                    session,
                    lock,
                    self._idle_key,
                    self._pinned_key,
                    self._tail_key(claim.key),
                    self._responses_key(response_group(claim.key)),
                ],
                args=[claim.fence, claim.key, cutoff],
            )
        )
        return bool(removed)

    async def peek(self, key: str) -> Stored:
        version, head, tail, claimed = await self._call(
            self._peek(keys=[*self._keys(key), self._tail_key(key)])
        )
        if version is None or head is None:
            return Stored(version=0, data=None, claimed=bool(claimed))
        return Stored(version=int(version), data=_joined(head, tail), claimed=bool(claimed))

    async def idle(self, *, before: float, limit: int) -> list[str]:
        members = await self._call(
            self._redis.zrangebyscore(
                self._idle_key, "-inf", f"({int(before * 1000)}", start=0, num=limit
            )
        )
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    async def take_idle(self, *, before: float, limit: int, hold_s: float) -> list[str]:
        members = await self._call(
            self._take_idle(
                keys=[self._idle_key, f"{self._prefix}sweeping"],
                args=[int(before * 1000), limit, int(time.time() * 1000), int(hold_s * 1000)],
            )
        )
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    async def count(self) -> int:
        return int(await self._call(self._redis.zcard(self._idle_key)))

    async def pinned_idle(self, *, before: float, limit: int) -> list[tuple[str, float]]:
        members = await self._call(
            self._redis.zrangebyscore(
                self._pinned_key,
                "-inf",
                f"({int(before * 1000)}",
                start=0,
                num=limit,
                withscores=True,
            )
        )
        pairs = cast(list[tuple[bytes | str, float]], members)  # withscores: (member, score)
        return [
            (m.decode() if isinstance(m, bytes) else str(m), float(score) / 1000.0)
            for m, score in pairs
        ]

    async def put_response(
        self, key: str, response_id: str, record: bytes, *, count: int, ttl_s: float
    ) -> None:
        await self._call(
            self._put_response(
                keys=[self._responses_key(response_group(key))],
                args=[response_id, b"%d:%b" % (count, record), max(1, int(ttl_s * 1000))],
            )
        )

    async def get_response(self, group: str, response_id: str) -> bytes | None:
        value = await self._call(self._redis.hget(self._responses_key(group), response_id))
        if value is None:
            return None
        data = value.encode() if isinstance(value, str) else bytes(value)
        return data.partition(b":")[2]

    async def drop_responses(self, key: str, *, after: int) -> None:
        await self._call(
            self._drop_responses(keys=[self._responses_key(response_group(key))], args=[after])
        )

    async def shared_secret(self) -> str:
        key = f"{self._prefix}salt-secret"
        await self._call(self._redis.set(key, secrets.token_hex(32), nx=True))
        value = await self._call(self._redis.get(key))
        if value is None:  # deleted between the two calls: ask again
            return await self.shared_secret()
        return value.decode() if isinstance(value, bytes) else str(value)

    async def ping(self) -> bool:
        return bool(await self._call(self._redis.ping()))

    async def aclose(self) -> None:
        await self._redis.aclose()
