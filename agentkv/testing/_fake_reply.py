"""A transport-neutral reply, and the faults a test can inject into replies.

The MockTransport and the real HTTP server both serve :class:`Reply` objects: a status and a
body, or a connection-level failure (``timeout``, ``reset``, ``refused``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, cast, get_args

from agentkv.testing._fake_protocol import error_body, status_error_type
from agentkv.testing._fake_responses import dumps, encode_sse

FaultKind = Literal[
    "status",
    "timeout",
    "reset",
    "malformed_json",
    "truncated_json",
    "no_kv_transfer_params",
    "bad_kv_transfer_params",
]
FAULT_KINDS: Final[tuple[str, ...]] = get_args(FaultKind)
ConnectionFailure = Literal["timeout", "reset", "refused"]

_MALFORMED: Final = b'{"id": "chatcmpl-fake", "choices": [}'


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What a fake server answers: JSON, SSE chunks, raw text, or no answer at all."""

    status: int = 200
    json: Any = None
    chunks: tuple[dict[str, Any], ...] | None = None
    stream_error: dict[str, Any] | None = None
    text: bytes | None = None
    content_type: str | None = "application/json"
    failure: ConnectionFailure | None = None
    truncated: bool = False
    malformed: bool = False

    @classmethod
    def error(cls, status: int, body: dict[str, Any]) -> Reply:
        return cls(status=status, json=body)

    @property
    def is_stream(self) -> bool:
        return self.chunks is not None

    def body(self) -> bytes:
        if self.malformed:
            data = (b"data: " + _MALFORMED + b"\n\n") if self.is_stream else _MALFORMED
        elif self.chunks is not None:
            data = encode_sse(list(self.chunks), error=self.stream_error)
        elif self.text is not None:
            data = self.text
        else:
            data = dumps(self.json)
        return data[: len(data) // 2] if self.truncated else data


@dataclass
class Fault:
    kind: FaultKind
    path: str
    remaining: int
    status: int = 500
    # The error answer's message, for a ``status`` fault (None: a generic one).
    message: str | None = None


@dataclass
class FaultQueue:
    """Faults armed by ``FakeServer.fail_next``, consumed in order by matching requests."""

    faults: list[Fault] = field(default_factory=list)

    def arm(
        self, kind: str, *, times: int, status: int, path: str, message: str | None = None
    ) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        if times < 1:
            raise ValueError("times must be at least 1")
        self.faults.append(Fault(cast(FaultKind, kind), path, times, status, message))

    def take(self, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.path == path:
                fault.remaining -= 1
                if fault.remaining == 0:
                    self.faults.remove(fault)
                return fault
        return None

    def clear(self) -> None:
        self.faults.clear()


def injected_status(status: int, message: str | None = None) -> Reply:
    return Reply.error(
        status,
        error_body(
            message or "Injected failure (agentkv fake)",
            err_type=status_error_type(status),
            code=status,
            param=None,
        ),
    )


def apply_fault(fault: Fault, reply: Reply) -> Reply:
    """Distort a processed reply: the server did the work, the client sees this."""
    if fault.kind in ("timeout", "reset"):
        return replace(reply, failure=fault.kind)
    if fault.kind == "malformed_json":
        return replace(reply, malformed=True)
    if fault.kind == "truncated_json":
        return replace(reply, truncated=True)
    return _rewrite_params(reply, fault.kind)


def _rewrite_params(reply: Reply, kind: str) -> Reply:
    def rewrite(params: Any) -> Any:
        if kind == "no_kv_transfer_params":
            return None
        bad = dict(params) if isinstance(params, dict) else {"do_remote_decode": True}
        bad["remote_block_ids"] = "corrupted"
        bad["remote_engine_id"] = None
        bad.pop("remote_num_tokens", None)
        return bad

    if reply.chunks is not None:
        chunks = [dict(c) for c in reply.chunks]
        if chunks:
            new = rewrite(chunks[-1].get("kv_transfer_params"))
            chunks[-1].pop("kv_transfer_params", None)
            if new is not None:
                chunks[-1]["kv_transfer_params"] = new
        return replace(reply, chunks=tuple(chunks))
    if isinstance(reply.json, dict) and "choices" in reply.json:
        body = dict(reply.json)
        body["kv_transfer_params"] = rewrite(body.get("kv_transfer_params"))
        return replace(reply, json=body)
    return reply
