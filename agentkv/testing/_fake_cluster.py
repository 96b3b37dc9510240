"""The fake cluster: N prefill/decode pairs of fake vLLM servers sharing one KV fabric."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from agentkv.testing._fake_clock import ManualClock
from agentkv.testing._fake_context import ServerContext
from agentkv.testing._fake_engine import (
    BYTES_PER_TOKEN,
    EngineConfig,
    FakeEngine,
    KVLoadFailurePolicy,
)
from agentkv.testing._fake_http import ServedCluster, serve_cluster
from agentkv.testing._fake_model import FakeModel
from agentkv.testing._fake_server import FakeServer, Role
from agentkv.testing._fake_template import CHAT_TEMPLATES, ChatTemplate
from agentkv.testing._fake_tier import DEFAULT_BUDGET_BYTES, FakeTier
from agentkv.testing._fake_tokenizer import FakeTokenizer
from agentkv.testing._fake_transport import FakeTransport

# VLLM_CPU_KVCACHE_SPACE=1 GiB holds about this many SmolLM2-135M tokens.
_DEFAULT_KV_CACHE_TOKENS = 46_592
_HTTP_PORT = 8000
_SIDE_CHANNEL_BASE_PORT = 5600


class _Fabric:
    """NIXL side channels: which engine answers at a host and port."""

    def __init__(self) -> None:
        self.by_side_channel: dict[tuple[str, int], FakeServer] = {}
        self.wrong_reuse_events = 0

    def lookup(self, host: Any, port: Any) -> FakeEngine | None:
        try:
            server = self.by_side_channel.get((host, port))
        except TypeError:
            return None
        return None if server is None else server.engine

    def record_wrong_reuse(self, reader: FakeEngine) -> None:
        del reader
        self.wrong_reuse_events += 1


class FakeCluster:
    """In-process fake of N vLLM prefill/decode pairs (NixlConnector, bidirectional KV).

    The servers speak vLLM 0.32's HTTP/JSON; ``transport`` serves them to httpx2 clients at
    ``http://fake-p{i}.test:8000`` and ``http://fake-d{i}.test:8000``.

    By default they run as ``agentkv up`` starts vLLM: with agentkv's plugin (handles on streams,
    ``stream_handles``) and connector (pin hints and lease routes, ``leases``, capped at
    ``agentkv_max_ttl_s``). ``leases=False, stream_handles=False`` is stock vLLM: no
    ``/v1/agentkv/*`` routes, no lease acknowledgement; ``leases=False`` alone is the plugin with
    vLLM's own connector (``/v1/agentkv/info`` says ``leases: false``).

    ``tier=True`` gives the servers a shared file tier (``agentkv_tier_dir``, as ``agentkv up``
    configures; ``fake.tier`` is the :class:`FakeTier`, bounded by ``tier_budget_bytes``):
    decode offloads leased handles there, prefill resumes from it. Without it the offload route
    answers 501 ``tier_unavailable``.

    ``tokenizer`` replaces the fake's own byte-level one with any object of its interface that
    has SmolLM2's special-token ids (``benchmarks/proxy_memory.py`` wraps SmolLM2's real
    tokenizer in one, so that sessions hold as many tokens as they would on the real model).

    Example:
        >>> import httpx2
        >>> from agentkv.testing import FakeCluster, ManualClock
        >>> fake = FakeCluster(pairs=1, clock=ManualClock())
        >>> client = httpx2.Client(transport=fake.transport)
        >>> messages = [{"role": "user", "content": "Hi"}]
        >>> p = client.post(f"{fake.prefill(0).url}/v1/chat/completions", json={
        ...     "messages": messages, "max_tokens": 1,
        ...     "kv_transfer_params": {"do_remote_decode": True}}).json()
        >>> d = client.post(f"{fake.decode(0).url}/v1/chat/completions", json={
        ...     "messages": messages, "kv_transfer_params": p["kv_transfer_params"]}).json()
        >>> handle = d["kv_transfer_params"]  # pinned on fake-d0 for the next turn
        >>> fake.decode(0).pinned_handles
        1
        >>> fake.advance(480.0)  # the pin's TTL runs out
        >>> fake.decode(0).pinned_handles
        0
    """

    def __init__(
        self,
        pairs: int = 2,
        *,
        block_size: int = 16,
        decoder_kv_blocks_ttl: float = 480.0,
        kv_recompute_threshold: int = 64,
        clock: Callable[[], float] = time.monotonic,
        model: str = "fake-smollm2",
        stream_handles: bool = True,
        max_model_len: int = 8192,
        chat_template: ChatTemplate = "smollm2",
        tool_call_parser: str | None = "hermes",
        enable_auto_tool_choice: bool = True,
        num_kv_blocks: int | None = None,
        kv_lease_duration: float = 30.0,
        kv_load_failure_policy: KVLoadFailurePolicy = "fail",
        bidirectional_kv_xfer: bool = True,
        leases: bool = True,
        agentkv_max_ttl_s: float = 3600.0,
        prefills: int | None = None,
        decodes: int | None = None,
        tier: bool = False,
        tier_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        tokenizer: FakeTokenizer | None = None,
    ) -> None:
        if pairs < 1:
            raise ValueError("a cluster needs at least one pair")
        # A pool (xPyD): ``prefills`` and ``decodes`` servers, ``pool_spec`` describes them.
        self._pool = prefills is not None or decodes is not None
        num_prefill = pairs if prefills is None else prefills
        num_decode = pairs if decodes is None else decodes
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a pool needs at least one prefill and one decode server")
        if chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"chat_template must be one of {CHAT_TEMPLATES}")
        self._clock = clock
        self._fabric = _Fabric()
        self.tokenizer = tokenizer or FakeTokenizer()
        self.model = model
        self.tool_call_parser = tool_call_parser
        """The servers' ``--tool-call-parser`` (``None``: tools go through agentkv's JSON)."""
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_kv_blocks or _DEFAULT_KV_CACHE_TOKENS // block_size + 1,
            decoder_kv_blocks_ttl=decoder_kv_blocks_ttl,
            kv_recompute_threshold=kv_recompute_threshold,
            kv_lease_duration=kv_lease_duration,
            bidirectional_kv_xfer=bidirectional_kv_xfer,
            kv_load_failure_policy=kv_load_failure_policy,
            leases=leases,
            agentkv_max_ttl_s=agentkv_max_ttl_s,
        )
        self.tier: FakeTier | None = (
            FakeTier(
                block_size=block_size,
                bytes_per_token=BYTES_PER_TOKEN,
                budget_bytes=tier_budget_bytes,
                clock=clock,
            )
            if tier
            else None
        )
        """The servers' shared file tier (``tier=True``), else ``None``."""
        context = ServerContext(
            model=model,
            max_model_len=max_model_len,
            stream_handles=stream_handles,
            chat_template=chat_template,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
            engine_config=config,
            tokenizer=self.tokenizer,
            fake_model=FakeModel(self.tokenizer, reasoning=chat_template == "rerender"),
            clock=clock,
            fabric=self._fabric,
            lock=threading.RLock(),
            tier=self.tier,
        )
        self._prefill = [self._server(context, "prefill", i) for i in range(num_prefill)]
        self._decode = [self._server(context, "decode", i) for i in range(num_decode)]
        self._by_netloc = {s.url.removeprefix("http://"): s for s in self.servers}
        self.transport = FakeTransport(self._by_netloc.get)

    def _server(self, context: ServerContext, role: Role, index: int) -> FakeServer:
        letter = role[0]
        host = f"fake-{letter}{index}.test"
        side_channel = (host, _SIDE_CHANNEL_BASE_PORT + 2 * index + (role == "decode"))
        server = FakeServer(
            name=f"fake-{letter}{index}",
            role=role,
            url=f"http://{host}:{_HTTP_PORT}",
            side_channel=side_channel,
            context=context,
        )
        self._fabric.by_side_channel[side_channel] = server
        return server

    def __repr__(self) -> str:
        if self._pool:
            return (
                f"FakeCluster(prefills={len(self._prefill)}, decodes={len(self._decode)}, "
                f"model={self.model!r})"
            )
        return f"FakeCluster(pairs={len(self._prefill)}, model={self.model!r})"

    @property
    def servers(self) -> list[FakeServer]:
        """Every server: prefill servers first, then decode servers."""
        return [*self._prefill, *self._decode]

    def server(self, url: str) -> FakeServer:
        """The server answering at ``url``: a pair's ``prefill`` or ``decode``, or any URL on it.

        Example:
            >>> fake = FakeCluster(pairs=2)
            >>> fake.server(fake.cluster_spec["pairs"][1]["decode"]) is fake.decode(1)
            True
            >>> fake.server("http://fake-p0.test:8000/v1/chat/completions").role
            'prefill'
        """
        server = self._by_netloc.get(urlsplit(url).netloc)
        if server is None:
            raise KeyError(f"no fake server answers at {url!r}")
        return server

    def prefill(self, index: int) -> FakeServer:
        return self._prefill[index]

    def decode(self, index: int) -> FakeServer:
        return self._decode[index]

    @property
    def pool_spec(self) -> dict[str, Any]:
        """The servers as a pool: ``{"model", "prefill": [{name, url}], "decode": [{name, url}]}``.

        Example:
            >>> FakeCluster(prefills=2, decodes=1).pool_spec["decode"]
            [{'name': 'fake-d0', 'url': 'http://fake-d0.test:8000'}]
        """
        return {
            "model": self.model,
            "prefill": [{"name": s.name, "url": s.url} for s in self._prefill],
            "decode": [{"name": s.name, "url": s.url} for s in self._decode],
        }

    @property
    def cluster_spec(self) -> dict[str, Any]:
        """The cluster in cluster-file shape: ``{"model", "pairs": [{name, prefill, decode}]}``
        (``pool_spec`` for a cluster made with ``prefills=``/``decodes=``)."""
        if self._pool:
            return self.pool_spec
        return {
            "model": self.model,
            "pairs": [
                {"name": f"pair-{i}", "prefill": p.url, "decode": d.url}
                for i, (p, d) in enumerate(zip(self._prefill, self._decode, strict=True))
            ],
        }

    @property
    def wrong_reuse_events(self) -> int:
        """Pulls whose KV was not the new prompt's prefix (wrong history, stale blocks)."""
        return self._fabric.wrong_reuse_events

    def advance(self, seconds: float) -> None:
        """Move a :class:`ManualClock` forward (handles expire on the next request)."""
        if not isinstance(self._clock, ManualClock):
            raise TypeError("advance() needs FakeCluster(clock=ManualClock())")
        self._clock.advance(seconds)

    @contextmanager
    def serve(self) -> Iterator[ServedCluster]:
        """Serve the cluster over real HTTP on 127.0.0.1 (needs ``uvicorn``).

        Example:
            >>> with FakeCluster(pairs=1).serve() as served:
            ...     served.cluster_spec["pairs"][0]["prefill"].startswith("http://127.0.0.1:")
            True
        """
        if self._pool:
            raise NotImplementedError("serve() serves pairs; build the fake with pairs=")
        pairs = list(zip(self._prefill, self._decode, strict=True))
        with serve_cluster(pairs, model=self.model) as served:
            yield served
