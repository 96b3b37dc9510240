"""Errors as OpenAI clients expect them: a status code and ``{"error": {...}}``.

Every failure the proxy answers goes through ``ProxyError``: the proxy's own refusals are raised
as one, and ``from_exception`` maps agentkv's tree onto statuses (a failed upstream server is the
proxy's 502, not the client's 500). Upstream details that name internal URLs stay in the logs.

>>> error = ProxyError(400, "bad", param="messages")
>>> error.body()["error"]["type"], error.status
('invalid_request_error', 400)
"""

from __future__ import annotations

from typing import Any

from agentkv._core import (
    AgentKVError,
    BadRequestError,
    ContextLengthError,
    InvalidMessageError,
    JSONDecodeError,
    MalformedResponseError,
    PrefixDivergedError,
    RequestTimeoutError,
    RoutingError,
    SessionBusyError,
    SessionClosedError,
    TemplateError,
    TransportError,
    UpstreamStatusError,
    loads,
)

__all__ = ["ProxyError", "context_length_exceeded"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ProxyError(Exception):
    """An error answer: HTTP ``status`` with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_exception(cls, exc: BaseException, *, input_param: str = "messages") -> ProxyError:
        """The answer for an exception raised while serving a request.

        ``input_param`` names the request's input, for a prompt over the context: chat's
        ``messages``, the Responses API's ``input``.
        """
        if isinstance(exc, ProxyError):
            return exc
        if isinstance(exc, ContextLengthError):
            return context_length_exceeded(exc, param=input_param)
        # A model server that says when to come back (429, 503) is passed on as it said it.
        retry_after = exc.retry_after_s if isinstance(exc, UpstreamStatusError) else None
        headers = None if retry_after is None else {"Retry-After": f"{retry_after:g}"}
        if isinstance(exc, BadRequestError):
            # The model server refused the request (too long a prompt, bad sampling values):
            # the client's fault, so its status and message go back as they are.
            return cls(
                exc.status_code, _upstream_message(exc), code="upstream_rejected", headers=headers
            )
        for kind, status, code, message in _MAPPED:
            if isinstance(exc, kind):
                return cls(
                    status, message or str(exc), code=code or type(exc).__name__, headers=headers
                )
        return cls(500, "internal error", code="internal_error")


# Checked in order: subclasses before their bases. A ``None`` message passes the exception's own
# (it names no server); a ``None`` code is the exception's class name.
_MAPPED: tuple[tuple[type[BaseException], int, str | None, str | None], ...] = (
    (InvalidMessageError, 400, "invalid_message", None),
    (PrefixDivergedError, 400, None, None),
    (TemplateError, 400, None, None),
    (SessionClosedError, 409, "session_closed", "the session was closed while this request waited"),
    (SessionBusyError, 409, "session_busy", None),
    (UpstreamStatusError, 502, "upstream_error", "the model server failed"),
    (RequestTimeoutError, 504, "upstream_timeout", "the model server did not answer in time"),
    (TransportError, 502, "upstream_unreachable", "the model server is unreachable"),
    (MalformedResponseError, 502, "upstream_error", "the model server sent an unexpected answer"),
    (RoutingError, 503, "no_healthy_pair", "no healthy model server"),
    (AgentKVError, 500, None, "internal error"),
)


def context_length_exceeded(exc: ContextLengthError, *, param: str) -> ProxyError:
    """OpenAI's answer to a prompt over the context, in its words and code: agents act on the
    code (Codex compacts its history on ``context_length_exceeded``).

    >>> err = context_length_exceeded(
    ...     ContextLengthError(prompt_tokens=9000, max_tokens=None, limit=8192), param="messages")
    >>> err.status, err.code, err.message.split(". ")[1]
    (400, 'context_length_exceeded', 'However, your messages resulted in 9000 tokens')
    """
    limit = exc.limit
    if exc.max_tokens is None:
        message = (
            f"This model's maximum context length is {limit} tokens. However, your messages "
            f"resulted in {exc.prompt_tokens} tokens. Please reduce the length of the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{exc.prompt_tokens + exc.max_tokens} tokens ({exc.prompt_tokens} in the messages, "
            f"{exc.max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    return ProxyError(400, message, code="context_length_exceeded", param=param)


def _upstream_message(exc: UpstreamStatusError) -> str:
    """vLLM's own error message (``{"error": {"message"}}`` or ``{"message"}``), never its URL."""
    try:
        data = loads(exc.response_body)
    except (JSONDecodeError, ValueError):
        return "the model server rejected the request"
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
    return "the model server rejected the request"
