"""Any Messages body gets an answer, never a 5xx, and a refused one commits nothing.

Hypothesis mutates a valid Claude-Code-shaped ``/v1/messages`` body (a field replaced by any
JSON value, removed, or a block's field replaced) and posts it to the proxy on the fake pair:
the status is 200 or a 4xx in Anthropic's error shape, and after a 4xx the session the request
named does not exist (nothing was committed for it).
"""

from __future__ import annotations

import copy
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster

SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                  max_size=4),
    max_leaves=12,
)


def _valid() -> dict[str, Any]:
    return {
        "model": FakeCluster(pairs=1).model,
        "max_tokens": 16,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.abc;"},
                   {"type": "text", "text": "You are a coding agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Running ls."},
                {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py b.py"},
            ]},
        ],
        "tools": [{"name": "bash", "description": "Run a command.", "input_schema": {
            "type": "object", "properties": {"command": {"type": "string"}}}}],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": '{"session_id": "fuzz"}'},
        "thinking": {"type": "adaptive"},
        "stream": False,
    }


FIELDS = [*_valid().keys(), "temperature", "top_p", "top_k", "stop_sequences", "diagnostics",
          "output_config", "context_management"]
PATHS = [("messages", 0, "content", 0, "text"), ("messages", 1, "content", 1, "input"),
         ("messages", 1, "content", 1, "id"), ("messages", 2, "content", 0, "tool_use_id"),
         ("messages", 2, "content", 0, "content"), ("messages", 1, "role"),
         ("messages", 2, "content", 0, "type"), ("tools", 0, "input_schema"), ("tools", 0, "name"),
         ("system", 1, "text"), ("system", 0), ("messages", 0)]


def _child(node: Any, key: str | int) -> Any:
    """``node[key]`` where it exists (an earlier mutation may have replaced the path)."""
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list) and isinstance(key, int) and key < len(node):
        return node[key]
    return None


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = _valid()
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["replace", "remove", "deep"]))
        if kind == "deep":
            *parents, last = draw(st.sampled_from(PATHS))
            node: Any = body
            for key in parents:
                node = _child(node, key)
            if isinstance(node, dict) or (isinstance(node, list) and last < len(node)):
                node[last] = draw(JSON)
            continue
        field = draw(st.sampled_from(FIELDS))
        if kind == "remove":
            body.pop(field, None)
        else:
            body[field] = draw(JSON)
    return copy.deepcopy(body)


pytestmark = [pytest.mark.slow, pytest.mark.fake(pairs=1, kv_recompute_threshold=0)]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies())
async def test_any_messages_body_is_answered_without_a_5xx(module_fake: FakeCluster,
                                                           body: dict[str, Any]) -> None:
    fake = module_fake
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        app = create_app(cluster, ProxyConfig())
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                      base_url="http://proxy") as http:
            headers = {"X-Claude-Code-Session-Id": "fuzz-session"}
            response = await http.post("/v1/messages", json=body, headers=headers)
            event(f"status {response.status_code}")
            assert response.status_code < 500, (response.status_code, response.text, body)
            session = await http.get("/v1/sessions/fuzz-session")
            if response.status_code >= 400:
                error = response.json()
                assert error["type"] == "error", error
                assert isinstance(error["error"]["message"], str)
                assert session.status_code == 404, (session.text, body)
            else:
                assert session.status_code == 200, session.text
