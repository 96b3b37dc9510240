"""Every error agentkv raises, in one tree.

::

    AgentKVError
    ├── TransportError               the request never got an HTTP answer
    │   ├── ConnectError             could not connect (server down, refused, DNS)
    │   ├── RequestTimeoutError      connected, but no answer in time
    │   └── ConnectionLostError      connected, then the connection broke (reset, cut answer)
    ├── UpstreamStatusError          the server answered with an error status
    │   ├── BadRequestError          4xx: the request is wrong; retrying will not help
    │   └── ServerError              5xx: the server failed; retried where safe
    ├── MalformedResponseError       a 2xx answer unlike vLLM's (bad JSON, missing fields)
    ├── RoutingError                 no server to send a turn to
    │   └── NoHealthyPairError       every prefill/decode pair is marked unhealthy
    ├── SessionError                 the session cannot do what was asked
    │   ├── PrefixDivergedError      the new prompt does not extend what the decode node holds
    │   ├── SessionClosedError       the session was closed
    │   ├── SessionBusyError         a turn is already running on this session
    │   └── SessionLoadError         a saved session is unreadable, corrupt or of another version
    ├── TemplateError                the chat template cannot be rendered as an append-only delta
    ├── InvalidMessageError          a message is empty, has an unknown role or non-string content
    ├── ContextLengthError           the prompt (and the asked output) exceed the context
    └── ConfigError                  a cluster file or setting is wrong

The agent runtime's tool errors (defined in ``agentkv/_agent/tools.py``) hang off the same root::

    AgentKVError
    └── ToolError                    a tool could not be defined, called or run
        ├── ToolDefinitionError      the function cannot be a tool (missing hint, clashing names)
        ├── UnknownToolError         the model called a tool that does not exist
        ├── ToolArgumentsError       the model's arguments do not fit the tool's schema
        ├── ToolTimeoutError         the tool ran past its timeout
        ├── ToolExecutionError       the tool raised (the original is ``__cause__``)
        └── ToolCallFormatError      the model's reply is not tool calls in the asked format

Inside an agent loop these become tool-result messages the model sees; they never end the run.

Every error that comes from an HTTP exchange says which server and which request it was about, so
logs read without a debugger:

>>> err = ServerError("prefill failed", status_code=503, url="http://p:8000/v1/chat/completions",
...                   request_summary="chat.completions max_tokens=1", response_body="overloaded")
>>> isinstance(err, UpstreamStatusError), err.status_code
(True, 503)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv import _constants as defaults

if TYPE_CHECKING:
    import httpx2

__all__ = [
    "AgentKVError",
    "BadRequestError",
    "ConfigError",
    "ConnectError",
    "ConnectionLostError",
    "ContextLengthError",
    "InvalidMessageError",
    "MalformedResponseError",
    "NoHealthyPairError",
    "PrefixDivergedError",
    "RequestTimeoutError",
    "RoutingError",
    "ServerError",
    "SessionBusyError",
    "SessionClosedError",
    "SessionError",
    "SessionLoadError",
    "TemplateError",
    "TransportError",
    "UpstreamStatusError",
]

_BODY_LIMIT = defaults.ERROR_BODY_LIMIT


class AgentKVError(Exception):
    """Base of every error agentkv raises."""


class TransportError(AgentKVError):
    """The request got no HTTP answer.

    Attributes:
        url: where the request went.
    """

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class ConnectError(TransportError):
    """Could not connect to the server: it is down, refused the connection or is unreachable."""


class RequestTimeoutError(TransportError):
    """Connected, but the answer did not come in time.

    Named so it does not shadow the builtin ``TimeoutError``.
    """


class ConnectionLostError(TransportError):
    """Connected, then the connection broke: reset by the peer, or the answer was cut short."""


class UpstreamStatusError(AgentKVError):
    """The server answered with an error status.

    Attributes:
        status_code: the HTTP status.
        url: where the request went.
        request_summary: a short description of the request (never the whole prompt).
        response_body: the start of the server's answer.
        request: the ``httpx2.Request`` sent, when the error came from an exchange.
        response: the ``httpx2.Response`` (its headers: ``retry-after``, ``x-request-id``, ...),
            as openai-python's ``APIStatusError`` carries it.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        url: str = "",
        request_summary: str = "",
        response_body: str = "",
        request: httpx2.Request | None = None,
        response: httpx2.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.url = url
        self.request_summary = request_summary
        self.response_body = response_body[:_BODY_LIMIT]
        self.request = request
        self.response = response

    @property
    def request_id(self) -> str | None:
        """The server's id of the failed request (``x-request-id``), when it sent one."""
        return None if self.response is None else self.response.headers.get("x-request-id")

    @property
    def retry_after_s(self) -> float | None:
        """The server's ``retry-after``, in seconds, when it is a number."""
        value = None if self.response is None else self.response.headers.get("retry-after")
        try:
            return None if value is None else float(value)
        except ValueError:
            return None

    def __str__(self) -> str:
        text = f"{self.args[0]} (HTTP {self.status_code} from {self.url})"
        if self.request_summary:
            text += f"; request: {self.request_summary}"
        if self.response_body:
            text += f"; response: {self.response_body}"
        return text


class BadRequestError(UpstreamStatusError):
    """A 4xx answer: the request is wrong (for example a sampling value out of range).

    A prompt over the model's context is a ``ContextLengthError`` instead, raised before the
    request is sent, or from the server's own 400 about it.
    """


class ServerError(UpstreamStatusError):
    """A 5xx answer: the server failed. agentkv retries these where that is safe."""


class MalformedResponseError(AgentKVError):
    """A 2xx answer that is not what vLLM sends: bad JSON, or a field missing or of the wrong type.

    Attributes:
        url: where the request went.
        detail: what was missing or wrong.
    """

    def __init__(self, message: str, *, url: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.detail = detail

    def __str__(self) -> str:
        text = str(self.args[0])
        if self.detail:
            text += f": {self.detail}"
        if self.url:
            text += f" (from {self.url})"
        return text


class RoutingError(AgentKVError):
    """No server to send a turn to."""


class NoHealthyPairError(RoutingError):
    """Every prefill/decode pair of the cluster is marked unhealthy."""


class SessionError(AgentKVError):
    """The session cannot do what was asked."""


class PrefixDivergedError(SessionError):
    """The new prompt does not extend the tokens the decode node holds.

    Sending the old handle with it would load wrong KV (vLLM's pull is positional and unchecked),
    so agentkv refuses. Start a new transcript with ``session.fork(...)`` instead.
    """


class SessionClosedError(SessionError):
    """The session was closed; open a new one."""


class SessionBusyError(SessionError):
    """A turn is already running on this session; a session runs one turn at a time."""


class SessionLoadError(SessionError):
    """A saved session (``Session.load``) is unreadable, corrupt, or of an unknown version."""


class TemplateError(AgentKVError):
    """The chat template cannot be rendered as an append-only delta for these messages.

    agentkv computes the tokens of new messages by rendering a small anchor conversation with and
    without them. When the template renders the anchor differently once messages follow it, the
    delta is not well defined and agentkv refuses rather than guess.
    """


class InvalidMessageError(AgentKVError):
    """A message is empty, has an unknown role, or content that is not a string."""


class ContextLengthError(AgentKVError):
    """The prompt does not fit the model's context, or leaves no room for the asked output.

    Each API answers it in its own words, the ones its agents act on (OpenAI's
    ``context_length_exceeded``; Anthropic's ``prompt is too long`` and ``input length and
    `max_tokens` exceed context limit``).

    Attributes:
        prompt_tokens: the prompt's length in tokens.
        max_tokens: the output asked for, or ``None`` when the prompt alone does not fit.
        limit: the model's context (``max_model_len``).
    """

    def __init__(self, *, prompt_tokens: int, max_tokens: int | None, limit: int) -> None:
        if max_tokens is None:
            message = f"the prompt is {prompt_tokens} tokens, over the context of {limit}"
        else:
            message = (
                f"the prompt's {prompt_tokens} tokens and max_tokens {max_tokens} exceed the"
                f" context of {limit}"
            )
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


class ConfigError(AgentKVError):
    """A cluster file or setting is wrong."""
