"""``BodyDeadline``, the proxy's body-read deadline, as ASGI middleware over a scripted client:
the pace it enforces, and the memory it asks back after bodies that were never read whole."""

from __future__ import annotations

import asyncio
from typing import Any

from agentkv.proxy._deadline import BodyDeadline, BodyPace
from agentkv.proxy._errors import ProxyError

PIECE = b" " * (512 * 1024)


class _Client:
    """``receive`` for ``pieces`` body pieces, then a stall (or the end, with ``whole``)."""

    def __init__(self, pieces: int, *, whole: bool = False, every_s: float = 0.0) -> None:
        self.pieces = pieces
        self.whole = whole
        self.every_s = every_s

    async def receive(self) -> dict[str, Any]:
        if self.pieces == 0:
            await asyncio.Event().wait()  # stalled for good
        await asyncio.sleep(self.every_s)
        self.pieces -= 1
        return {"type": "http.request", "body": PIECE, "more_body": self.pieces or not self.whole}


async def _read_all(scope: Any, receive: Any, send: Any) -> None:
    """An app that reads the whole body, answering its status (408 when cut)."""
    del scope
    status = 200
    try:
        while (await receive()).get("more_body"):
            pass
    except ProxyError as error:
        status = error.status
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def _serve(app: BodyDeadline, client: _Client) -> int:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http"}, client.receive, send)
    return int(sent[0]["status"])


async def test_a_stalled_body_is_cut_at_the_gap_and_a_steady_one_is_read_whole():
    app = BodyDeadline(_read_all, pace=BodyPace(timeout_s=0.1, min_rate=None), trim=None)
    assert await _serve(app, _Client(2)) == 408
    steady = BodyDeadline(_read_all, pace=BodyPace(timeout_s=0.1, min_rate=1e6), trim=None)
    # 0.3 s in all, three times the head start: pieces earn their time at 1 MB/s.
    assert await _serve(steady, _Client(6, whole=True, every_s=0.05)) == 200


async def test_bodies_left_unread_ask_one_trim_a_second_later_and_whole_ones_none():
    trims: list[float] = []
    loop = asyncio.get_running_loop()
    app = BodyDeadline(
        _read_all,
        pace=BodyPace(timeout_s=0.05, min_rate=None),
        trim=lambda: trims.append(loop.time()),
    )
    assert await _serve(app, _Client(4, whole=True)) == 200
    started = loop.time()
    # Three cut at once (1.5 MiB read each), and one cut below the threshold.
    statuses = await asyncio.gather(*(_serve(app, _Client(n)) for n in (3, 3, 3, 1)))
    assert statuses == [408] * 4
    await asyncio.sleep(1.5)
    assert len(trims) == 1
    # One second after the first cut (0.05 s in), not at each.
    assert 1.0 <= trims[0] - started < 1.3
