"""Jinja-free chat templates and a character tokenizer, for testing template deltas.

* ``chatml``: SmolLM2's ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), tools in the system
  message, tool calls as ``<tool_call>json</tool_call>``.
* ``thinking``: ChatML that re-renders *past* assistant turns without their ``<think>`` block
  (like Qwen3 / DeepSeek-R1 templates), so re-rendering history changes its tokens.
* ``grouped_tools``: consecutive tool results share one user block (like Qwen2.5), so a tool
  message's tokens change when another follows it.
* ``counting``: puts the number of messages in the system prompt: not append-stable at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from agentkv import Message

SPECIALS = {"<|im_start|>": 1, "<|im_end|>": 2}
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))
_BY_ID = {v: k for k, v in SPECIALS.items()}
IM_END = SPECIALS["<|im_end|>"]


def encode(text: str) -> list[int]:
    out: list[int] = []
    pos = 0
    for match in _SPECIAL_RE.finditer(text):
        out.extend(10 + ord(c) for c in text[pos : match.start()])
        out.append(SPECIALS[match.group()])
        pos = match.end()
    out.extend(10 + ord(c) for c in text[pos:])
    return out


def decode(ids: Sequence[int]) -> str:
    return "".join(_BY_ID.get(i) or chr(i - 10) for i in ids)


def _tools_text(tools: Any) -> str:
    return "\n\n# Tools\n" + json.dumps(tools, sort_keys=True) if tools else ""


def _calls_text(message: Message) -> str:
    return "".join(
        f"<tool_call>{json.dumps({'name': c.name, 'arguments': c.arguments})}</tool_call>"
        for c in message.tool_calls
    )


def _system_prefix(messages: Sequence[Message], tools: Any) -> tuple[str, Sequence[Message]]:
    if messages and messages[0].role == "system":
        text = f"<|im_start|>system\n{messages[0].content}{_tools_text(tools)}<|im_end|>\n"
        return text, messages[1:]
    if tools:
        return f"<|im_start|>system\n{_tools_text(tools).strip()}<|im_end|>\n", messages
    return "", messages


def chatml(messages: Sequence[Message], tools: Any, add_generation_prompt: bool) -> str:
    text, rest = _system_prefix(messages, tools)
    for m in rest:
        body = (m.content or "") + (_calls_text(m) if m.role == "assistant" else "")
        text += f"<|im_start|>{m.role}\n{body}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def thinking(messages: Sequence[Message], tools: Any, add_generation_prompt: bool) -> str:
    text, rest = _system_prefix(messages, tools)
    last_user = max((i for i, m in enumerate(rest) if m.role == "user"), default=-1)
    for i, m in enumerate(rest):
        content = m.content or ""
        if m.role == "assistant" and i < last_user:
            content = _THINK.sub("", content)  # past turns lose their reasoning
        body = content + (_calls_text(m) if m.role == "assistant" else "")
        text += f"<|im_start|>{m.role}\n{body}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def grouped_tools(messages: Sequence[Message], tools: Any, add_generation_prompt: bool) -> str:
    text, rest = _system_prefix(messages, tools)
    for i, m in enumerate(rest):
        if m.role == "tool":
            first = i == 0 or rest[i - 1].role != "tool"
            last = i == len(rest) - 1 or rest[i + 1].role != "tool"
            text += ("<|im_start|>user\n" if first else "\n") + f"<tool_response>{m.content}"
            text += "<|im_end|>\n" if last else ""
            continue
        body = (m.content or "") + (_calls_text(m) if m.role == "assistant" else "")
        text += f"<|im_start|>{m.role}\n{body}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def counting(messages: Sequence[Message], tools: Any, add_generation_prompt: bool) -> str:
    text = f"<|im_start|>system\n{len(messages)} messages<|im_end|>\n"
    return text + chatml(messages, tools, add_generation_prompt)


Template = Callable[[Sequence[Message], Any, bool], str]


class LocalRenderer:
    """A ``Renderer`` over one of the templates above; counts its calls."""

    def __init__(self, template: Template = chatml) -> None:
        self.template = template
        self.calls = 0

    async def render(
        self, messages: Sequence[Message], *, tools: Any, add_generation_prompt: bool
    ) -> list[int]:
        self.calls += 1
        return encode(self.template(messages, tools, add_generation_prompt))
