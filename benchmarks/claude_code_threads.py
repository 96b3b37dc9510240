"""Claude Code's threads through ``/v1/messages`` on the real pair: a parent, two sibling
subagents, and Claude Code's per-session billing line, with the reuse each first and later turn
gets.

Requests are shaped as Claude Code 2.1 sends them (docs/clients.md): the billing line as the
first system block (another suffix per session, ``cc_is_subagent=true;`` for a subagent),
``X-Claude-Code-Session-Id``, subagents with ``x-claude-code-agent-id``, messages sent as text
blocks and re-sent as strings. Printed, from each answer's own usage (``cache_read_input_tokens``
is prefill's count of prompt tokens it did not compute):

* the parent's turn 2 while both subagents run (reuse against the ideal: previous prompt +
  generated - 1);
* subagent A's first turn (nothing of its prompt shared with the parent but the model's chat
  frame), then sibling B's first turn, which shares A's whole system prompt (prefill's prefix
  cache holds it when the threads are placed on one pair);
* each subagent's turn 2;
* two sessions with the same system prompt and different billing lines: the second session's
  first-turn reuse with the proxy's default drop rule, and without it
  (``--no-default-system-drops``).

    .venv/bin/python benchmarks/claude_code_threads.py [--cluster-file .agentkv/cluster.json]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import httpx2
import structlog

from agentkv import AsyncCluster
from agentkv.local._cpu import read_cpu_info
from agentkv.proxy import ProxyConfig, create_app

BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=sdk-cli;{}"
PARENT = "You are Claude Code, a coding agent. " + " ".join(
    f"Rule {i}: keep module {i} small and typed." for i in range(60))
EXPLORE = "You are an Explore subagent: search the code, report findings. " + " ".join(
    f"Guideline {i}: read file {i * 7 % 97} before you answer." for i in range(60))


def _system(text: str, suffix: str, *, subagent: bool = False) -> list[dict[str, Any]]:
    billing = BILLING.format(suffix, " cc_is_subagent=true;" if subagent else "")
    return [{"type": "text", "text": billing},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


class Thread:
    """One Claude Code thread's requests and what each answer reused."""

    def __init__(self, http: httpx2.AsyncClient, model: str, headers: dict[str, str],
                 system: list[dict[str, Any]]) -> None:
        self.http, self.model, self.headers, self.system = http, model, headers, system
        self.messages: list[dict[str, Any]] = []
        self.last: dict[str, int] | None = None

    async def turn(self, text: str) -> dict[str, float]:
        self.messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        body = {"model": self.model, "max_tokens": 24, "temperature": 0.0,
                "system": self.system, "messages": self.messages}
        response = await self.http.post("/v1/messages?beta=true", json=body,
                                        headers=self.headers, timeout=600)
        response.raise_for_status()
        data = response.json()
        usage = data["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        ideal = (self.last["prompt"] + self.last["output"] - 1) if self.last else None
        self.last = {"prompt": prompt, "output": usage["output_tokens"]}
        # Claude Code re-sends the last user message as a plain string next time.
        self.messages[-1] = {"role": "user", "content": text}
        answer = "".join(b.get("text", "") for b in data["content"]) or "(empty)"
        self.messages.append({"role": "assistant", "content": answer})
        return {"prompt": prompt, "reused": usage["cache_read_input_tokens"],
                **({"ideal": ideal} if ideal is not None else {})}


async def _threads(cluster: AsyncCluster) -> dict[str, Any]:
    app = create_app(cluster, ProxyConfig())
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://proxy") as http:
        session = {"X-Claude-Code-Session-Id": str(uuid.uuid4())}
        parent = Thread(http, cluster.model, session, _system(PARENT, "a1f"))
        sub_a = Thread(http, cluster.model, {**session, "x-claude-code-agent-id": "a-1"},
                       _system(EXPLORE, "9c2", subagent=True))
        sub_b = Thread(http, cluster.model, {**session, "x-claude-code-agent-id": "a-2"},
                       _system(EXPLORE, "9c2", subagent=True))
        results: dict[str, Any] = {"parent_1": await parent.turn("Plan the refactor of module 7.")}
        results["sub_a_1"] = await sub_a.turn("Find where module 7 is imported.")
        parent_2, sub_b_1, sub_a_2 = await asyncio.gather(
            parent.turn("Go on with the plan."),
            sub_b.turn("Find the tests of module 7."),
            sub_a.turn("Look in the tests too."),
        )
        results.update(parent_2=parent_2, sub_b_1=sub_b_1, sub_a_2=sub_a_2)
        results["sub_b_2"] = await sub_b.turn("And the docs?")
        return results


async def _billing(cluster: AsyncCluster, *, rule: bool) -> dict[str, float]:
    """Two sessions, one system prompt, two billing suffixes: the second's first turn."""
    app = create_app(cluster, ProxyConfig() if rule else ProxyConfig(drop_system_blocks=()))
    text = f"You are a coding agent ({'with' if rule else 'without'} the rule). " + PARENT
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://proxy") as http:
        first = Thread(http, cluster.model, {"X-Claude-Code-Session-Id": str(uuid.uuid4())},
                       _system(text, "0a1"))
        await first.turn("Hello.")
        second = Thread(http, cluster.model, {"X-Claude-Code-Session-Id": str(uuid.uuid4())},
                        _system(text, "7be"))
        return await second.turn("Hello.")


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    async with AsyncCluster.from_file(args.cluster_file) as cluster:
        threads = await _threads(cluster)
        billing = {"with_rule": await _billing(cluster, rule=True),
                   "without_rule": await _billing(cluster, rule=False)}
    for name, turn in {**threads, **{f"billing_{k}": v for k, v in billing.items()}}.items():
        against = turn.get("ideal", turn["prompt"])
        print(f"[claude_code_threads] {name}: reused {turn['reused']} of"
              f" {'ideal' if 'ideal' in turn else 'prompt'} {against}"
              f" ({turn['reused'] / against:.1%})", flush=True)
    return {"cpu": read_cpu_info().model, "threads": threads, "billing": billing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster-file", default=".agentkv/cluster.json")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    report = asyncio.run(_main(args))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
