"""agentkv: client-side KV reuse for multi-turn LLM agents on disaggregated vLLM (prefill/decode).

>>> import agentkv
>>> with agentkv.Cluster.from_file(".agentkv/cluster.json") as cluster:  # doctest: +SKIP
...     with cluster.session() as s:
...         s.append(agentkv.Message.user("What is the capital of France?"))
...         print(s.turn().text)
"""

from agentkv._cluster import AsyncCluster, Cluster, Pair
from agentkv._exceptions import (
    AgentKVError,
    BadRequestError,
    ConfigError,
    ConnectError,
    ConnectionLostError,
    InvalidMessageError,
    MalformedResponseError,
    NoHealthyPairError,
    PrefixDivergedError,
    RequestTimeoutError,
    RoutingError,
    ServerError,
    SessionBusyError,
    SessionClosedError,
    SessionError,
    TemplateError,
    TransportError,
    UpstreamStatusError,
)
from agentkv._policy import AttachDecision, CachePolicy, RetryPolicy
from agentkv._session import AsyncSession, Session, TurnOverrides
from agentkv._transcript import Span, TranscriptView
from agentkv._types import (
    HandleState,
    KVHandle,
    Message,
    MessageLike,
    SessionStats,
    TextDelta,
    ToolCall,
    TurnResult,
    TurnStats,
)

__all__ = [
    "AgentKVError",
    "AsyncCluster",
    "AsyncSession",
    "AttachDecision",
    "BadRequestError",
    "CachePolicy",
    "Cluster",
    "ConfigError",
    "ConnectError",
    "ConnectionLostError",
    "HandleState",
    "InvalidMessageError",
    "KVHandle",
    "MalformedResponseError",
    "Message",
    "MessageLike",
    "NoHealthyPairError",
    "Pair",
    "PrefixDivergedError",
    "RequestTimeoutError",
    "RetryPolicy",
    "RoutingError",
    "ServerError",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionError",
    "SessionStats",
    "Span",
    "TemplateError",
    "TextDelta",
    "ToolCall",
    "TranscriptView",
    "TransportError",
    "TurnOverrides",
    "TurnResult",
    "TurnStats",
    "UpstreamStatusError",
]
