"""agentkv: client-side KV reuse for multi-turn LLM agents on disaggregated vLLM (prefill/decode).

>>> import agentkv
>>> with agentkv.Cluster.from_file(".agentkv/cluster.json") as cluster:  # doctest: +SKIP
...     with cluster.session() as s:
...         s.append(agentkv.Message.user("What is the capital of France?"))
...         print(s.turn().text)
"""

import inspect as _inspect
import typing as _typing
from importlib import metadata as _metadata

from agentkv._agent.agent import Agent, AgentOptions, AsyncAgent
from agentkv._agent.events import (
    AgentEvent,
    AgentStep,
    HandleExpiredEvent,
    RunResult,
    StopReason,
    TextEvent,
    ToolCallEvent,
    ToolResultEvent,
    TurnEvent,
)
from agentkv._agent.tool_calling import (
    FINAL_ANSWER,
    JsonToolCalling,
    ModelReply,
    NativeToolCalling,
    ToolCalling,
)
from agentkv._agent.tools import (
    Tool,
    ToolArgumentsError,
    ToolCallFormatError,
    ToolDefinitionError,
    ToolError,
    ToolExecutionError,
    ToolSpec,
    ToolTimeoutError,
    UnknownToolError,
    tool,
)
from agentkv._agent.toolset import ToolResult, ToolSet
from agentkv._client.cluster import AsyncCluster, Cluster
from agentkv._client.offload import OffloadMode
from agentkv._client.pool import ClusterOptions
from agentkv._client.session import AsyncSession, Session
from agentkv._client.tool_wait import ToolWait
from agentkv._exceptions import (
    AgentKVError,
    BadRequestError,
    ConfigError,
    ConnectError,
    ConnectionLostError,
    ContextLengthError,
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
    SessionLoadError,
    TemplateError,
    TransportError,
    UpstreamStatusError,
)
from agentkv._log import configure_logging
from agentkv._placement import PrefillWeights, RetryPolicy
from agentkv._policy import (
    AttachDecision,
    CachePolicy,
    ExtendDecision,
    PersistMode,
    TierCostModel,
    TierDecision,
)
from agentkv._prompt.history import HistoryPlan, PrefixBreak
from agentkv._prompt.transcript import Span, TranscriptView
from agentkv._route import Route, RouteCostModel, RouteDecision, RoutePolicy
from agentkv._types import (
    HandleState,
    KVHandle,
    Message,
    MessageLike,
    Pair,
    SessionStats,
    TextDelta,
    ToolCall,
    TurnOverrides,
    TurnResult,
    TurnStats,
)
from agentkv._wire.tier import TierRef

if _typing.TYPE_CHECKING:
    from agentkv._anthropic.client import Anthropic, AsyncAnthropic
    from agentkv._openai.client import AsyncOpenAI, OpenAI

__all__ = [
    "FINAL_ANSWER",
    "Agent",
    "AgentEvent",
    "AgentKVError",
    "AgentOptions",
    "AgentStep",
    "Anthropic",
    "AsyncAgent",
    "AsyncAnthropic",
    "AsyncCluster",
    "AsyncOpenAI",
    "AsyncSession",
    "AttachDecision",
    "BadRequestError",
    "CachePolicy",
    "Cluster",
    "ClusterOptions",
    "ConfigError",
    "ConnectError",
    "ConnectionLostError",
    "ContextLengthError",
    "ExtendDecision",
    "HandleExpiredEvent",
    "HandleState",
    "HistoryPlan",
    "InvalidMessageError",
    "JsonToolCalling",
    "KVHandle",
    "MalformedResponseError",
    "Message",
    "MessageLike",
    "ModelReply",
    "NativeToolCalling",
    "NoHealthyPairError",
    "OffloadMode",
    "OpenAI",
    "Pair",
    "PersistMode",
    "PrefillWeights",
    "PrefixBreak",
    "PrefixDivergedError",
    "RequestTimeoutError",
    "RetryPolicy",
    "Route",
    "RouteCostModel",
    "RouteDecision",
    "RoutePolicy",
    "RoutingError",
    "RunResult",
    "ServerError",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionError",
    "SessionLoadError",
    "SessionStats",
    "Span",
    "StopReason",
    "TemplateError",
    "TextDelta",
    "TextEvent",
    "TierCostModel",
    "TierDecision",
    "TierRef",
    "Tool",
    "ToolArgumentsError",
    "ToolCall",
    "ToolCallEvent",
    "ToolCallFormatError",
    "ToolCalling",
    "ToolDefinitionError",
    "ToolError",
    "ToolExecutionError",
    "ToolResult",
    "ToolResultEvent",
    "ToolSet",
    "ToolSpec",
    "ToolTimeoutError",
    "ToolWait",
    "TranscriptView",
    "TransportError",
    "TurnEvent",
    "TurnOverrides",
    "TurnResult",
    "TurnStats",
    "UnknownToolError",
    "UpstreamStatusError",
    "configure_logging",
    "tool",
]

try:
    __version__: str = _metadata.version("agentkv")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree that is not installed
    __version__ = "0+unknown"


def _public(obj: object) -> None:
    # Public names live at the top (``agentkv.Message``, not ``agentkv._types.Message``): in
    # reprs, tracebacks, pickles and docs, as httpx2 does. Only classes and functions: type
    # aliases and constants (``FINAL_ANSWER``) are values, left as they are.
    if isinstance(obj, type) or _inspect.isfunction(obj):
        obj.__module__ = "agentkv"


# The openai and anthropic drop-ins serve requests with the proxy's app, which needs starlette
# (the ``proxy`` extra) and their SDK: imported on first use, so ``import agentkv`` stays light.
_LAZY = frozenset({"Anthropic", "AsyncAnthropic", "AsyncOpenAI", "OpenAI"})

for _name in __all__:
    if _name not in _LAZY:
        _public(globals()[_name])


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        if name.endswith("Anthropic"):
            from agentkv._anthropic import client as anthropic_client

            value = getattr(anthropic_client, name)
        else:
            from agentkv._openai import client as openai_client

            value = getattr(openai_client, name)
        _public(value)
        return value
    raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
