"""Errors on the Messages routes as Anthropic's API answers them.

``{"type": "error", "error": {"type": ..., "message": ...}}`` with Anthropic's statuses: every
failure is first the proxy's own ``ProxyError`` (``ProxyError.from_exception``), then given the
Anthropic type of its status. A prompt over the context is said in the words Claude Code parses
(and acts on by retrying with less): ``prompt is too long: N tokens > M maximum``, and
``input length and `max_tokens` exceed context limit: A + B > C``. No healthy model server is
Anthropic's ``overloaded_error`` (529), which its clients retry.

>>> status, body = anthropic_error(ProxyError(413, "too big"))
>>> status, body["error"]["type"]
(413, 'request_too_large')
"""

from __future__ import annotations

from typing import Any

from agentkv._core import ContextLengthError
from agentkv.proxy._errors import ProxyError

__all__ = ["anthropic_error", "context_message", "error_event", "proxy_error"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_OVERLOADED = 529


def context_message(exc: ContextLengthError) -> str:
    """``ContextLengthError`` in Anthropic's words."""
    if exc.max_tokens is None:
        return f"prompt is too long: {exc.prompt_tokens} tokens > {exc.limit} maximum"
    return (
        "input length and `max_tokens` exceed context limit: "
        f"{exc.prompt_tokens} + {exc.max_tokens} > {exc.limit}"
    )


def proxy_error(exc: BaseException) -> ProxyError:
    """``ProxyError.from_exception``, with a prompt over the context in Anthropic's words."""
    if isinstance(exc, ContextLengthError):
        return ProxyError(400, context_message(exc), code="context_length_exceeded")
    return ProxyError.from_exception(exc)


def anthropic_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and body answering ``exc``."""
    error = proxy_error(exc)
    status = _OVERLOADED if error.status == 503 else error.status
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


def error_event(exc: BaseException) -> dict[str, Any]:
    """The ``error`` stream event of a failure after the answer began."""
    return anthropic_error(exc)[1]
