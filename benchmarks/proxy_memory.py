"""The proxy's memory per open session, with sessions as many tokens long as on the real model.

Runs the proxy's app in this process (ASGI, no sockets) on the fake pair, whose tokenizer here is
SmolLM2-135M's real one (transformers' ``AutoTokenizer``, from the prepared model in
``~/.cache/agentkv/models/smollm2-135m-bfloat16``; no vLLM server): the fake renders SmolLM2's
chat template and encodes it with that tokenizer, and its answers are real token ids, so each
session's transcript holds as many ids as on the real model. Opens SESSIONS sessions of TURNS
turns each (``X-Session-ID``, every request re-sending the whole history, as OpenAI clients do),
once with a short system prompt and once with a long one, and measures what the proxy holds for
them: the Python heap's growth (``tracemalloc``), less what the fake servers' own code allocated
(their KV, their request logs), after a collection. The two runs give bytes per session and a
fit, ``bytes = fixed + per_token * tokens``, whose slope is what a session costs per token of
its transcript.

    .venv/bin/python benchmarks/proxy_memory.py [--sessions 100] [--turns 6] [--frames 8]

About 3 minutes on 2 cores (tracemalloc slows every allocation).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import platform
import tracemalloc
from pathlib import Path
from typing import Any

import httpx2
import structlog

from agentkv import AsyncCluster
from agentkv.proxy import ProxyConfig, create_app
from agentkv.testing import FakeCluster, ManualClock
from agentkv.testing._fake_tokenizer import SPECIAL_TOKENS, FakeTokenizer, _bytes_to_unicode

MODEL_DIR = Path.home() / ".cache/agentkv/models/smollm2-135m-bfloat16"
# Support conversations: the system prompt sets the length, the turns are short questions.
POLICY = (
    "Refunds are issued within 14 days of a return being received at the warehouse. Orders "
    "shipped to a wrong address are re-sent at no cost once the customer confirms the address. "
    "Damaged items are replaced, never repaired; ask for a photo first. "
)
QUESTIONS = (
    "My order is late, it was due last Tuesday. Can you check where it is?",
    "It was order 41-2207, shipped to Leeds.",
    "The tracking page has not changed in four days. Is that normal?",
    "Can I get a refund instead if it does not arrive this week?",
    "And if it arrives damaged, what should I do?",
    "Thanks. Please summarise what happens next.",
    "One more thing: can I change the delivery address now?",
    "Great, that is all for today.",
)


class SmolLM2Tokenizer(FakeTokenizer):
    """SmolLM2's real tokenizer behind the fake's interface (same special-token ids: 0-2)."""

    def __init__(self, path: Path) -> None:  # the base's vocabulary is replaced, not built
        from transformers import AutoTokenizer  # only this benchmark needs it

        self._hf: Any = AutoTokenizer.from_pretrained(str(path))
        tokens = self._hf.convert_ids_to_tokens(list(range(len(self._hf))))
        assert tokens[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS), tokens[:3]
        to_byte = {char: byte for byte, char in _bytes_to_unicode().items()}
        self._pieces = tuple(
            token.encode() if i < len(SPECIAL_TOKENS) else bytes(to_byte[c] for c in token)
            for i, token in enumerate(tokens)
        )
        self._ids = {}
        for i, piece in enumerate(self._pieces):
            if i >= len(SPECIAL_TOKENS):
                self._ids.setdefault(piece, i)
        # Printable bytes all have a token of their own (the fake splits words into them).
        self._byte_ids = {b: self._ids[bytes([b])] for b in range(32, 127)}
        self.max_chars_per_token = max(len(piece) for piece in self._pieces)

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def byte_ids(self, text: str) -> list[int]:
        return [self._byte_ids[b] for b in text.encode()]


def _heap(exclude: tracemalloc.Filter) -> int:
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces([exclude])
    return sum(stat.size for stat in snapshot.statistics("filename"))


async def _run(
    tokenizer: SmolLM2Tokenizer, *, sessions: int, turns: int, system: str
) -> tuple[float, float]:
    """Bytes the proxy holds per open session, and tokens per session's transcript."""
    fake = FakeCluster(pairs=2, clock=ManualClock(), tokenizer=tokenizer)
    exclude = tracemalloc.Filter(False, "*/agentkv/testing/*", all_frames=True)
    async with AsyncCluster.from_dict(fake.cluster_spec, transport=fake.transport) as cluster:
        app = create_app(cluster, ProxyConfig(max_sessions=sessions + 1))
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://proxy") as client:

            async def converse(session_id: str) -> None:
                messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
                for turn in range(turns):
                    messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                    answer = await client.post(
                        "/v1/chat/completions",
                        json={"messages": messages, "max_tokens": 48, "temperature": 0},
                        headers={"X-Session-ID": session_id},
                    )
                    answer.raise_for_status()
                    messages.append(answer.json()["choices"][0]["message"])

            await converse("warm-up")  # templates, metrics, logger: made once per proxy
            for server in fake.servers:
                server.requests.clear()
            before = _heap(exclude)
            for i in range(sessions):
                await converse(f"s{i}")
            for server in fake.servers:
                server.requests.clear()
            held = _heap(exclude) - before
            registry = app.state.registry
            tokens = [
                len(entry.session.transcript.token_ids)
                for entry in registry._entries.values()
                if entry.session_id != "warm-up"
            ]
            await registry.close_all()
    return held / sessions, sum(tokens) / len(tokens)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--frames", type=int, default=8, help="frames kept per allocation")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    tokenizer = SmolLM2Tokenizer(args.model_dir)
    tracemalloc.start(args.frames)
    runs = []
    for label, system in (("short", POLICY), ("long", POLICY * 20)):
        per_session, tokens = asyncio.run(
            _run(tokenizer, sessions=args.sessions, turns=args.turns, system=system)
        )
        runs.append((per_session, tokens))
        print(
            f"{label} system prompt: {per_session / 1024:.1f} KiB per session, "
            f"{tokens:.0f} tokens per transcript, {per_session / tokens:.1f} bytes per token"
        )
    (b1, t1), (b2, t2) = runs
    per_token = (b2 - b1) / (t2 - t1)
    print(
        f"fit: {(b1 - per_token * t1) / 1024:.1f} KiB per session + {per_token:.1f} bytes per "
        f"transcript token ({args.sessions} sessions x {args.turns} turns, SmolLM2's tokenizer; "
        f"CPU: {_cpu()}, {os.cpu_count()} cores; Python {platform.python_version()})"
    )


if __name__ == "__main__":
    main()
