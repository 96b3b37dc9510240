"""Chat templates of the fake model: SmolLM2's ChatML and a history-re-rendering variant.

``"smollm2"`` renders exactly what SmolLM2-135M-Instruct's Jinja template renders (checked
against the model's ``chat_template.jinja``)::

    {% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}
    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face
    <|im_end|>\\n{% endif %}<|im_start|>{role}\\n{content}<|im_end|>\\n{% endfor %}
    {% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}

``"rerender"`` is the same, except that an assistant message followed by a later user message
loses its ``<think>...</think>`` part, the way reasoning models' templates (Qwen3, DeepSeek-R1)
re-render history: the turn-end tokens of turn N are then *not* a prefix of turn N+1's
rendering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

ChatTemplate = Literal["smollm2", "rerender"]
CHAT_TEMPLATES: Final[tuple[ChatTemplate, ...]] = ("smollm2", "rerender")
DEFAULT_SYSTEM_PROMPT: Final = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
)
THINK_END: Final = "</think>"


class TemplateError(ValueError):
    """The messages cannot be rendered (a 400 on the server)."""


def message_text(message: Mapping[str, Any]) -> str:
    """Content as vLLM hands it to a string-format template.

    ``None`` (an assistant message with only tool calls) renders as ``""``; a list of text
    parts is joined with newlines.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type", "text") != "text":
                raise TemplateError("fake-smollm2 only accepts text content parts")
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError("a text content part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise TemplateError(f"unsupported message content: {type(content).__name__}")


def strip_think(content: str) -> str:
    """What a reasoning template keeps of a past assistant message."""
    if THINK_END not in content:
        return content
    return content.rsplit(THINK_END, 1)[1].lstrip("\n")


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    template: ChatTemplate = "smollm2",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render ``messages`` to prompt text, as ``tokenizer.apply_chat_template`` would.

    With ``continue_final_message`` the text stops right after the last message's content
    (no ``<|im_end|>``), as transformers does.
    """
    if template not in CHAT_TEMPLATES:
        raise TemplateError(f"unknown chat template {template!r}")
    if continue_final_message and add_generation_prompt:
        # transformers' apply_chat_template; vLLM answers 400 with this reason.
        raise TemplateError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, "
            "and add_generation_prompt when you want to add a header that will prompt it to "
            "start a new assistant message instead."
        )
    roles = [_role(m) for m in messages]
    last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
    parts: list[str] = []
    if messages and roles[0] != "system":
        parts.append(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
    end_of_final_content = 0
    for i, (message, role) in enumerate(zip(messages, roles, strict=True)):
        content = message_text(message)
        if template == "rerender" and role == "assistant" and i < last_user:
            content = strip_think(content)
        parts.append(f"<|im_start|>{role}\n{content}")
        end_of_final_content = sum(len(p) for p in parts)
        parts.append("<|im_end|>\n")
    if continue_final_message:
        if not messages:
            raise TemplateError("continue_final_message needs at least one message")
        return "".join(parts)[:end_of_final_content]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _role(message: Mapping[str, Any]) -> str:
    role = message.get("role")
    if not isinstance(role, str):
        raise TemplateError("every message needs a string 'role'")
    return role
