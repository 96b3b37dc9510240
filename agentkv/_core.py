"""The one internal surface the apps import the core through.

The apps (``agentkv.proxy``, ``agentkv.cli``, ``agentkv.bench``, ``agentkv.local``,
``agentkv.integrations``, ``agentkv.testing`` and the drop-in ``agentkv._openai``) are built on
the SDK. They may use the public package and, besides it, exactly the names below; never a core
module (``agentkv._client``, ``agentkv._wire``, ...) directly, so that the core's layout can change
without touching them (``tests/unit/test_imports.py`` fails on a reach-in).

The public names are repeated here for the apps that the public package itself imports (the
proxy app that ``agentkv.OpenAI`` serves in-process): they must not import ``agentkv`` back, or
the package would import itself through them. This module imports core modules only.

The rest is not public, and is here for a reason each:

- ``Portal``: the one event loop on a thread (the proxy's server, the drop-in's sync transport,
  the fake pair's HTTP host run on it as the sync twins do).
- ``dumps``/``loads``/``JSONDecodeError``: orjson in and out.
- ``post_json``/``stream_events``: one exchange with a server through a ``Poster``, its errors
  agentkv's (the proxy's tool-parser probe, the benchmark's baselines); ``HttpxPoster``: an
  ``httpx2.AsyncClient`` as one (the benchmark's own clients).
- ``AUTO``/``NONE``/``REQUIRED``/``PASSED_FIELDS``/``refusal``: the request-field table (what a
  front end passes to decode, what it refuses and why).
- ``Transcript``/``ChatTemplate``/``ServerRenderer``: a turn's exact prompt built as a session
  builds it, without sending it through a pair (the benchmark's ``limit`` mode serves it on one
  server, so its token counts match the SDK modes').
- ``listening_socket``: the socket a uvicorn server is handed (the proxy's, the fake pair's
  HTTP host), with Nagle's delay off on the connections it accepts.
- ``Poster``/``Answer``/``Streamed``/``raise_transport_error``: the fakes' transport is a
  ``Poster``, as the default one is (``agentkv._wire.transport``), its failures mapped as an httpx2
  client's are, so a session on the fake cluster runs its real-server path.
- ``sample_values``: a few series out of a server's ``/metrics`` (the benchmark samples decode's
  KV usage as the SDK reads it before a tool wait).
- ``get_logger``/``configure_logging``: the quiet loggers every module logs through (events go
  to the stdlib logger ``agentkv`` and its children), and what the CLIs and the vLLM plugin call
  to print them.
- ``kv``: a session's reusable KV as one value (``agentkv._client.kv``): the proxy's shared store
  reads it (is it pinned, on which pair) where it hands sessions between replicas.
- the hint and file-tier wire values and routes: the benchmark's legs, ``agentkv status`` and the
  protocol-faithful fakes in ``agentkv.testing`` speak them. (The vLLM side, ``agentkv.connector``,
  is the protocol's other end and imports ``agentkv._wire`` itself.)
"""

from agentkv._agent.tool_calling import JsonToolCalling
from agentkv._agent.tools import ToolDefinitionError, ToolSpec
from agentkv._client import kv
from agentkv._client.cluster import AsyncCluster, Cluster
from agentkv._client.offload import OffloadMode, as_offload
from agentkv._client.portal import Portal
from agentkv._client.session import AsyncSession
from agentkv._exceptions import (
    AgentKVError,
    BadRequestError,
    ConfigError,
    ContextLengthError,
    InvalidMessageError,
    MalformedResponseError,
    PrefixDivergedError,
    RequestTimeoutError,
    RoutingError,
    SessionBusyError,
    SessionClosedError,
    TemplateError,
    TransportError,
    UpstreamStatusError,
)
from agentkv._log import configure_logging, get_logger
from agentkv._policy import PersistMode
from agentkv._prompt.history import HistoryPlan
from agentkv._prompt.template import ChatTemplate, ServerRenderer
from agentkv._prompt.transcript import Transcript, TranscriptView
from agentkv._route import ROUTES, Route
from agentkv._types import (
    HandleState,
    Message,
    Pair,
    TextDelta,
    ToolCall,
    TurnOverrides,
    TurnResult,
    TurnStats,
)
from agentkv._wire.fields import AUTO, NONE, PASSED_FIELDS, REQUIRED, refusal
from agentkv._wire.hints import (
    CLAIM_PATH,
    EXTEND_PATH,
    INFO_PATH,
    RELEASE_PATH,
    RELEASE_REQUEST_PATH,
    ExtendRequest,
    ExtendResult,
    HintError,
    LeaseRef,
    PinHint,
    RequestRelease,
    ServerInfo,
    lease_error,
    with_hint,
)
from agentkv._wire.http import HttpxPoster, post_json, raise_transport_error, stream_events
from agentkv._wire.json import JSONDecodeError, dumps, loads
from agentkv._wire.listen import listening_socket
from agentkv._wire.metrics import sample_values
from agentkv._wire.tier import (
    LEGACY_OFFLOAD_PATH,
    OFFLOAD_PATH,
    TIER_DELETE_PATH,
    OffloadRequest,
    OffloadResult,
    TierDelete,
    TierLoadReport,
    TierRef,
    TierUsage,
    with_tier_load,
)
from agentkv._wire.transport import Answer, Poster, Streamed

__all__ = [
    "AUTO",
    "CLAIM_PATH",
    "EXTEND_PATH",
    "INFO_PATH",
    "LEGACY_OFFLOAD_PATH",
    "NONE",
    "OFFLOAD_PATH",
    "PASSED_FIELDS",
    "RELEASE_PATH",
    "RELEASE_REQUEST_PATH",
    "REQUIRED",
    "ROUTES",
    "TIER_DELETE_PATH",
    "AgentKVError",
    "Answer",
    "AsyncCluster",
    "AsyncSession",
    "BadRequestError",
    "ChatTemplate",
    "Cluster",
    "ConfigError",
    "ContextLengthError",
    "ExtendRequest",
    "ExtendResult",
    "HandleState",
    "HintError",
    "HistoryPlan",
    "HttpxPoster",
    "InvalidMessageError",
    "JSONDecodeError",
    "JsonToolCalling",
    "LeaseRef",
    "MalformedResponseError",
    "Message",
    "OffloadMode",
    "OffloadRequest",
    "OffloadResult",
    "Pair",
    "PersistMode",
    "PinHint",
    "Portal",
    "Poster",
    "PrefixDivergedError",
    "RequestRelease",
    "RequestTimeoutError",
    "Route",
    "RoutingError",
    "ServerInfo",
    "ServerRenderer",
    "SessionBusyError",
    "SessionClosedError",
    "Streamed",
    "TemplateError",
    "TextDelta",
    "TierDelete",
    "TierLoadReport",
    "TierRef",
    "TierUsage",
    "ToolCall",
    "ToolDefinitionError",
    "ToolSpec",
    "Transcript",
    "TranscriptView",
    "TransportError",
    "TurnOverrides",
    "TurnResult",
    "TurnStats",
    "UpstreamStatusError",
    "as_offload",
    "configure_logging",
    "dumps",
    "get_logger",
    "kv",
    "lease_error",
    "listening_socket",
    "loads",
    "post_json",
    "raise_transport_error",
    "refusal",
    "sample_values",
    "stream_events",
    "with_hint",
    "with_tier_load",
]
