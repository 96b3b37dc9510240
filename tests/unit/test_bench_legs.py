"""The leg rewriter: cache salts on P legs, no pin on decode for the baselines, nothing else."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx2

from agentkv.bench._legs import LegRewriter

P = "http://p.test:8000"
D = "http://d.test:8001"


class Recorder(httpx2.AsyncBaseTransport):
    def __init__(self):
        self.bodies = []
        self.closed = False

    async def handle_async_request(self, request):
        content = await request.aread()
        assert int(request.headers.get("content-length", 0)) == len(content)
        self.bodies.append((str(request.url), json.loads(content) if content else None))
        return httpx2.Response(200, json={"ok": True})

    async def aclose(self):
        self.closed = True


def run(rewriter, *requests):
    async def send():
        async with httpx2.AsyncClient(transport=rewriter) as client:
            for method, url, body in requests:
                await client.request(method, url, json=body)

    asyncio.run(send())


def leg(url, **extra):
    return ("POST", url + "/v1/chat/completions",
            {"messages": [], "kv_transfer_params": {"do_remote_decode": True}, **extra})


def test_every_prefill_leg_gets_the_salt_the_source_gives():
    inner = Recorder()
    counter = itertools.count(1)
    rewriter = LegRewriter(inner, prefill=[P], decode=[D],
                           prefill_salt=lambda: f"s-p{next(counter)}", pin_on_decode=True)
    run(rewriter, leg(P), leg(P))
    assert [body["cache_salt"] for _, body in inner.bodies] == ["s-p1", "s-p2"]
    assert rewriter.prefill_legs == 2


def test_a_salt_the_sdk_sent_to_prefill_is_replaced_not_duplicated():
    inner = Recorder()
    rewriter = LegRewriter(inner, prefill=[P], decode=[D], prefill_salt=lambda: "mine",
                           pin_on_decode=True)
    run(rewriter, leg(P, cache_salt="sdk"))
    assert inner.bodies[0][1]["cache_salt"] == "mine"


def test_baseline_decode_legs_ask_decode_not_to_pin_and_keep_their_own_salt():
    inner = Recorder()
    rewriter = LegRewriter(inner, prefill=[P], decode=[D], prefill_salt=lambda: "x",
                           pin_on_decode=False)
    run(rewriter, leg(D, cache_salt="session"))
    body = inner.bodies[0][1]
    assert body["kv_transfer_params"]["agentkv"] == {"v": 1, "persist": False}
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert body["cache_salt"] == "session"


def test_agentkv_decode_legs_pass_unchanged():
    inner = Recorder()
    rewriter = LegRewriter(inner, prefill=[P], decode=[D], prefill_salt=lambda: "x",
                           pin_on_decode=True)
    run(rewriter, leg(D, cache_salt="session"))
    assert inner.bodies[0][1] == leg(D, cache_salt="session")[2]
    assert rewriter.decode_legs == 1


def test_other_requests_pass_untouched_and_closing_leaves_the_shared_transport_open():
    inner = Recorder()
    rewriter = LegRewriter(inner, prefill=[P], decode=[D], prefill_salt=lambda: "x",
                           pin_on_decode=False)
    run(rewriter, ("POST", P + "/tokenize", {"prompt": "hi"}), ("GET", P + "/health", None),
        leg("http://elsewhere.test:1"))
    assert [body for _, body in inner.bodies] == [
        {"prompt": "hi"}, None, leg("http://elsewhere.test:1")[2]
    ]
    assert not inner.closed


def test_server_cache_info_is_read_from_vllm_metrics_and_absent_otherwise():
    from agentkv.bench._env import server_cache

    metrics = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",'
        'kv_cache_size_tokens="46592"} 1.0\n'
    )

    def answer(request):
        if request.url.host == "down.test":
            raise httpx2.ConnectError("refused", request=request)
        return httpx2.Response(200, text=metrics if request.url.host == "p.test" else "")

    async def read(url):
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(answer)) as client:
            return await server_cache(client, url)

    assert asyncio.run(read(P)) == {
        "block_size": "128", "kv_cache_size_tokens": "46592", "enable_prefix_caching": "True"
    }
    assert asyncio.run(read(D)) is None
    assert asyncio.run(read("http://down.test:1")) is None
