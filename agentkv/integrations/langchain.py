"""LangChain: ``ChatAgentKV``, a chat model backed by an agentkv session.

A LangChain tool loop re-sends the whole conversation every call. ``ChatAgentKV`` lines that
history up with its session (``Session.sync_history``): only the new messages are rendered and
sent, and each turn pulls the previous turn's KV from the decode node, as an ``Agent`` does.
The ``AIMessage`` s it returns carry an id that maps back to the exact assistant message in the
transcript, so echoing them back never re-renders (and never moves) the prefix. A history that
does not extend the session's (a new conversation, an edited one) starts a new session.

Calls may run at once (LangChain's ``batch``/``abatch`` call from a thread pool): each call takes
a session no other call is using, the one whose history it extends when there is one, so every
batch item runs on a session of its own and a later batch of the extended conversations reuses
each one's KV. Idle sessions are kept (up to ``max_idle_sessions``, the least recently used
closed first), so conversations that take turns on one model (two agents sharing it, batch items
whose calls do not overlap) each keep their KV; ``close()`` releases them all.

Tool calling uses the same protocols as ``Agent`` (``JsonToolCalling`` by default: a
``final_answer`` call comes back as a plain ``AIMessage`` with the answer, so the usual
"loop while the model calls tools" ends). ``bind_tools(..., tool_choice=...)`` takes LangChain's
values (``"auto"``, ``"any"``/``"required"``: a tool now, ``"none"``, a tool name) and
``"final"``: the answer now.

>>> from langchain_core.messages import HumanMessage, ToolMessage
>>> with agentkv.Cluster.from_file(".agentkv/cluster.json") as cluster:  # doctest: +SKIP
...     llm = ChatAgentKV(cluster=cluster).bind_tools([add])
...     messages = [HumanMessage("What is 2 + 3?")]
...     while (ai := llm.invoke(messages)).tool_calls:
...         messages.append(ai)
...         messages += [ToolMessage(str(add.invoke(c["args"])), tool_call_id=c["id"])
...                      for c in ai.tool_calls]
...     print(ai.content)

Install with ``pip install 'agentkv[langchain]'``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from agentkv import (
    Cluster,
    InvalidMessageError,
    JsonToolCalling,
    Message,
    ModelReply,
    Session,
    Tool,
    ToolCall,
    ToolCalling,
    ToolExecutionError,
    ToolResult,
    ToolSpec,
    TurnOverrides,
    TurnResult,
)
from agentkv._core import AUTO, NONE, REQUIRED

__all__ = ["ChatAgentKV"]

# A reply that cannot be read as tool calls is retried this often within one invoke.
_FORMAT_RETRIES = 2
_ID_PREFIX = "agentkv-"


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    parts = [p if isinstance(p, str) else p.get("text", "") for p in content]
    return "\n".join(p for p in parts if isinstance(p, str))


def _tool_specs(tools: Sequence[Any]) -> list[ToolSpec]:
    specs = []
    for item in tools:
        if isinstance(item, Tool):
            specs.append(item.spec)
        else:
            specs.append(ToolSpec.from_openai(convert_to_openai_tool(item)))
    return sorted(specs, key=lambda spec: spec.name)


def _choice(tool_choice: Any, specs: Sequence[ToolSpec]) -> str:
    """LangChain's ``tool_choice`` values as an agentkv protocol choice."""
    if not specs or tool_choice == NONE:
        return NONE
    if tool_choice in (None, AUTO):
        return AUTO
    if tool_choice in ("any", REQUIRED, True):
        return REQUIRED
    if isinstance(tool_choice, Mapping):
        return str(tool_choice.get("function", {}).get("name", AUTO))
    return str(tool_choice)


class ChatAgentKV(BaseChatModel):
    """A LangChain chat model on an agentkv ``Cluster`` (see the module docstring).

    Args:
        cluster: the sync ``agentkv.Cluster`` to open sessions on.
        max_tokens: per turn.
        tool_calling: the tool-calling protocol (``JsonToolCalling()`` by default).
        extra_body: more fields for every decode request.
        max_idle_sessions: idle sessions kept for conversations that may come back (batch items,
            agents taking turns on one model); the least recently used is closed past it.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    cluster: Cluster = Field(exclude=True)
    max_tokens: int = 256
    tool_calling: Any = Field(default_factory=JsonToolCalling, exclude=True)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    max_idle_sessions: int = 32

    _session: Session | None = PrivateAttr(default=None)
    # Sessions no call is using, oldest first; a call takes one out for its whole turn.
    _idle: list[Session] = PrivateAttr(default_factory=list)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    # AIMessage id -> the exact transcript messages behind it (a retried reply is several).
    _committed: dict[str, tuple[Message, ...]] = PrivateAttr(default_factory=dict)

    @property
    def _llm_type(self) -> str:
        return "agentkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.cluster.model, "max_tokens": self.max_tokens}

    @property
    def session(self) -> Session | None:
        """The session of the conversation seen last (``None`` before the first call)."""
        return self._session

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models, dicts or agentkv tools).

        Specs are canonical and sorted by name, so the prompt prefix is the same whatever the
        order they are given in.
        """
        specs = [spec.to_openai() for spec in _tool_specs(tools)]
        return self.bind(tools=specs, tool_choice=tool_choice, **kwargs)

    def close(self) -> None:
        """Close the sessions no call is using (the cluster stays open)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._session = None
        for session in idle:
            session.close()

    # --- one call ---------------------------------------------------------------------------------

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        protocol: ToolCalling = self.tool_calling
        specs = [ToolSpec.from_openai(t) for t in kwargs.get("tools") or ()]
        choice = _choice(kwargs.get("tool_choice"), specs)
        # The tools the turn renders (with JSON tool calling: none, they are in the messages).
        tools = protocol.turn_options(specs, choice=choice).get("tools") if specs else None
        session = self._checkout(self._history(messages, specs, protocol), tools=tools)
        try:
            return self._run(session, specs, choice, protocol, stop=stop, kwargs=kwargs)
        finally:
            self._checkin(session)

    def _run(
        self,
        session: Session,
        specs: list[ToolSpec],
        choice: str,
        protocol: ToolCalling,
        *,
        stop: list[str] | None,
        kwargs: Mapping[str, Any],
    ) -> ChatResult:
        options: TurnOverrides = protocol.turn_options(specs, choice=choice) if specs else {}
        extra = {**self.extra_body, **options.get("extra_body", {})}
        if stop:
            extra["stop"] = list(stop)
        options["max_tokens"] = self.max_tokens
        if extra:
            options["extra_body"] = extra
        committed: list[Message] = []
        for attempt in range(_FORMAT_RETRIES + 1):
            result = session.turn(**options)
            committed.append(result.message)
            reply = protocol.parse(result) if specs else ModelReply(text=result.text)
            if reply.error is None or attempt == _FORMAT_RETRIES:
                break
            note = protocol.retry_message(reply.error)
            session.append(note)
            committed.append(note)
        ai = self._ai_message(result, reply, session, protocol)
        assert ai.id is not None
        self._committed[ai.id] = tuple(committed)
        return ChatResult(generations=[ChatGeneration(message=ai)])

    def _checkout(
        self, history: list[Message], *, tools: Sequence[Mapping[str, Any]] | None
    ) -> Session:
        """A session for ``history`` that no other call is using: one it extends, or a new one."""
        with self._lock:
            found = None
            for session in reversed(self._idle):  # the most recent first
                if session.sync_history(history, tools=tools).forked:
                    continue
                found = session
                break
            if found is not None:
                self._idle.remove(found)
            # A history that extends no idle session is a new conversation, not the end of the
            # others: they may come back (another agent on this model, a batch item whose call
            # finished before this one began). ``max_idle_sessions`` bounds what is kept.
        if found is not None:
            return found
        session = self.cluster.session(max_tokens=self.max_tokens)
        session.append(*history)
        return session

    def _checkin(self, session: Session) -> None:
        with self._lock:
            self._session = session
            self._idle.append(session)
            excess = self._idle[: max(0, len(self._idle) - self.max_idle_sessions)]
            del self._idle[: len(excess)]
        for old in excess:
            old.close()

    # --- conversions ------------------------------------------------------------------------------

    def _history(
        self, messages: Sequence[BaseMessage], specs: Sequence[ToolSpec], protocol: ToolCalling
    ) -> list[Message]:
        """LangChain messages as the session's messages; the same input always gives the same."""
        instructions = protocol.instructions(specs) if specs else ""
        out: list[Message] = []
        calls: dict[str, ToolCall] = {}
        if instructions and not (messages and isinstance(messages[0], SystemMessage)):
            out.append(Message.system(instructions))
        for index, message in enumerate(messages):
            if isinstance(message, SystemMessage):
                text = _text(message.content)
                if index == 0 and instructions:
                    text = f"{instructions}\n\n{text}" if text else instructions
                out.append(Message.system(text))
            elif isinstance(message, HumanMessage):
                out.append(Message.user(_text(message.content)))
            elif isinstance(message, AIMessage):
                known = self._committed.get(message.id or "")
                for call in message.tool_calls:
                    calls[call["id"] or ""] = ToolCall(
                        id=call["id"] or "", name=call["name"], arguments=json.dumps(call["args"])
                    )
                out.extend(known if known is not None else (_from_ai(message),))
            elif isinstance(message, ToolMessage):
                out.append(_from_tool(message, calls, protocol))
            else:
                raise InvalidMessageError(
                    f"ChatAgentKV does not take {type(message).__name__} messages"
                )
        return out

    def _ai_message(
        self, result: TurnResult, reply: ModelReply, session: Session, protocol: ToolCalling
    ) -> AIMessage:
        stats = result.stats
        tool_calls = []
        invalid = []
        for call in reply.calls:
            try:
                args = json.loads(call.arguments)
            except json.JSONDecodeError as exc:
                invalid.append(
                    {"name": call.name, "args": call.arguments, "id": call.id, "error": str(exc)}
                )
                continue
            tool_calls.append({"name": call.name, "args": args, "id": call.id, "type": "tool_call"})
        if reply.answer is not None:
            content = reply.answer
        elif reply.calls and isinstance(protocol, JsonToolCalling):
            content = ""  # the JSON is the calls themselves
        else:
            content = reply.text
        state = {
            k: v.value if hasattr(v, "value") else v for k, v in dataclasses.asdict(stats).items()
        }
        return AIMessage(
            content=content,
            tool_calls=tool_calls,
            invalid_tool_calls=invalid,
            id=f"{_ID_PREFIX}{session.session_id}-{stats.turn}",
            usage_metadata={
                "input_tokens": stats.prompt_tokens,
                "output_tokens": stats.generated_tokens,
                "total_tokens": stats.prompt_tokens + stats.generated_tokens,
                "input_token_details": {"cache_read": stats.reused_tokens},
            },
            response_metadata={
                "model_name": self.cluster.model,
                "finish_reason": result.finish_reason,
                "agentkv": state,
            },
        )


def _from_ai(message: AIMessage) -> Message:
    calls = tuple(
        ToolCall(id=c["id"] or "", name=c["name"], arguments=json.dumps(c["args"]))
        for c in message.tool_calls
    )
    text = _text(message.content)
    return Message.assistant(text if text or not calls else None, tool_calls=calls)


def _from_tool(
    message: ToolMessage, calls: Mapping[str, ToolCall], protocol: ToolCalling
) -> Message:
    call_id = message.tool_call_id
    call = calls.get(call_id) or ToolCall(id=call_id, name=message.name or "tool", arguments="{}")
    output = _text(message.content) or "(no output)"
    error = ToolExecutionError(output, tool=call.name) if message.status == "error" else None
    return protocol.result_message(ToolResult(call=call, output=output, error=error))
