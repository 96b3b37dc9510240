"""What every server of a fake cluster shares, and the checks all endpoints make."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentkv.testing._fake_engine import EngineConfig, Fabric
from agentkv.testing._fake_model import FakeModel
from agentkv.testing._fake_protocol import ApiError
from agentkv.testing._fake_template import ChatTemplate, TemplateError, render_chat
from agentkv.testing._fake_tier import FakeTier
from agentkv.testing._fake_tokenizer import FakeTokenizer


@dataclass(frozen=True, kw_only=True)
class ServerContext:
    """Model, server flags, clock and KV fabric, shared by the servers of one cluster."""

    model: str
    max_model_len: int
    stream_handles: bool
    chat_template: ChatTemplate
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    engine_config: EngineConfig
    tokenizer: FakeTokenizer
    fake_model: FakeModel
    clock: Callable[[], float]
    fabric: Fabric
    lock: threading.RLock
    # The file tier every server mounts (``None``: no ``agentkv_tier_dir``).
    tier: FakeTier | None = None

    def check_model(self, model: Any) -> None:
        """``_check_model``: an unknown model name is a 404."""
        if model and model != self.model:
            raise ApiError(
                f"The model `{model}` does not exist. Valid aliases: {self.model}.",
                status=404,
                err_type="NotFoundError",
                param="model",
            )

    @staticmethod
    def check_chat_template(template: Any, kwargs: Any) -> None:
        """Servers run without ``--trust-request-chat-template``."""
        if template is not None or (
            isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
        ):
            raise ApiError(
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template."
            )

    def render(
        self, messages: Any, *, add_generation_prompt: bool, continue_final_message: bool
    ) -> str:
        """The server's chat template; a template failure is a 400, as in vLLM."""
        try:
            return render_chat(
                messages,
                template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        except TemplateError as exc:
            raise ApiError(str(exc)) from exc
