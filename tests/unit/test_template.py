"""Chat-template deltas: new messages' tokens without re-rendering history."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest
from chatml_toy import (
    IM_END,
    LocalRenderer,
    chatml,
    counting,
    decode,
    encode,
    grouped_tools,
    thinking,
)

from agentkv import MalformedResponseError, Message, TemplateError, ToolCall
from agentkv._prompt.template import ChatTemplate, ServerRenderer, tools_key
from agentkv._prompt.transcript import Transcript
from agentkv._wire.http import HttpxPoster

SYSTEM = Message.system("You are terse.")
USER = Message.user("Capital of France?")
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


async def run_turns(template_fn, script, *, tools=None):
    """Drive a transcript through turns; ``script`` is [(new messages, generated text)].

    Returns (transcript, prompts) where prompts are each turn's exact token ids.
    """
    template = ChatTemplate(LocalRenderer(template_fn))
    transcript = Transcript()
    prompts = []
    for new, generated in script:
        transcript.append(*new)
        if transcript.is_fresh:
            delta = await template.first(transcript.pending, tools=tools)
            closing = ()
        else:
            delta = await template.delta(
                transcript.pending, last=transcript.last_message, tools=tools
            )
            closing = await template.closing(tools)
        prompt = transcript.prompt_for_turn(delta, closing=closing)
        prompts.append(prompt.tolist())
        ids = encode(generated)
        transcript.commit_turn(
            prompt,
            generated_ids=ids,
            message=Message.assistant(generated.removesuffix("<|im_end|>")),
            finish_reason="stop",
        )
    return transcript, prompts


async def test_first_prompt_is_a_full_render():
    template = ChatTemplate(LocalRenderer())
    delta = await template.first([SYSTEM, USER])
    assert decode(delta.token_ids) == chatml([SYSTEM, USER], None, True)
    assert decode(delta.token_ids[delta.generation_start :]) == "<|im_start|>assistant\n"
    assert delta.offsets == (0, len(encode(chatml([SYSTEM], None, False))))


async def test_closing_is_what_follows_assistant_content():
    template = ChatTemplate(LocalRenderer())
    assert decode(await template.closing()) == "<|im_end|>\n"


async def test_chatml_deltas_equal_a_full_render_when_history_is_stable():
    """For an append-stable template, delta prompts equal full renders of the conversation."""
    script = [
        ([SYSTEM, USER], "Paris.<|im_end|>"),
        ([Message.user("And Spain?")], "Madrid.<|im_end|>"),
        ([Message.user("Italy?")], "Rome.<|im_end|>"),
    ]
    _, prompts = await run_turns(chatml, script)
    history = [SYSTEM, USER]
    for i, (new, _answer) in enumerate(script):
        if i:
            history = [*history, Message.assistant(script[i - 1][1][: -len("<|im_end|>")]), *new]
        assert decode(prompts[i]) == chatml(history, None, True)
    # every prompt extends the previous prompt + generated ids
    for before, after, (_, answer) in zip(prompts, prompts[1:], script, strict=False):
        assert after[: len(before) + len(encode(answer))] == before + encode(answer)


async def test_rerendering_template_stays_token_exact_where_naive_rendering_diverges():
    """Past reasoning dropped by the template: deltas keep what the model saw; re-rendering not."""
    script = [
        ([SYSTEM, USER], "<think>France... Paris</think>Paris.<|im_end|>"),
        ([Message.user("And Spain?")], "<think>Spain</think>Madrid.<|im_end|>"),
        ([Message.user("Italy?")], "<think>hmm</think>Rome.<|im_end|>"),
    ]
    transcript, prompts = await run_turns(thinking, script)
    for before, after, (_, answer) in zip(prompts, prompts[1:], script, strict=False):
        assert after[: len(before) + len(encode(answer))] == before + encode(answer)
    # The naive approach (render the whole conversation each turn) loses turn 1's reasoning tokens,
    # so its prompt is not an extension of what decode holds: reusing KV with it would be wrong.
    naive = encode(thinking(list(transcript.messages), None, True))
    first_turn = prompts[0] + encode(script[0][1])
    assert naive[: len(first_turn)] != first_turn
    assert transcript.token_ids[: len(first_turn)] == tuple(first_turn)


async def test_closing_suffix_skips_the_generated_end_token():
    transcript, _ = await run_turns(chatml, [([USER], "Paris.<|im_end|>")])
    assert transcript.closing_suffix(encode("<|im_end|>\n")) == tuple(encode("\n"))
    assert transcript.token_ids[-1] == IM_END


async def test_length_cut_generation_gets_the_full_closing():
    template = ChatTemplate(LocalRenderer())
    transcript = Transcript([USER])
    prompt = transcript.prompt_for_turn(await template.first([USER]))
    transcript.commit_turn(
        prompt,
        generated_ids=encode("Par"),
        message=Message.assistant("Par"),
        finish_reason="length",
    )
    closing = await template.closing()
    assert transcript.closing_suffix(closing) == closing


async def test_tool_results_use_the_real_assistant_as_anchor_and_get_their_own_spans():
    call = ToolCall(id="c1", name="lookup", arguments='{"q": "France"}')
    asked = Message.assistant(None, tool_calls=[call])
    results = [Message.tool("Paris", tool_call_id="c1"), Message.tool("FR", tool_call_id="c1")]
    template = ChatTemplate(LocalRenderer(chatml))
    delta = await template.delta(results, last=asked, tools=TOOLS)
    text = decode(delta.token_ids)
    assert text == (
        "<|im_start|>tool\nParis<|im_end|>\n<|im_start|>tool\nFR<|im_end|>\n<|im_start|>assistant\n"
    )
    assert decode(delta.token_ids[delta.offsets[1] :]).startswith("<|im_start|>tool\nFR")


async def test_grouped_tool_results_share_a_span():
    call = ToolCall(id="c1", name="lookup", arguments="{}")
    results = [Message.tool("A", tool_call_id="c1"), Message.tool("B", tool_call_id="c1")]
    template = ChatTemplate(LocalRenderer(grouped_tools))
    delta = await template.delta(
        results, last=Message.assistant(None, tool_calls=[call]), tools=None
    )
    assert delta.offsets == (0, 0)  # the first result's tokens change when the second follows
    transcript = Transcript([USER])
    prompt = transcript.prompt_for_turn(await template.first([USER]))
    transcript.commit_turn(
        prompt,
        generated_ids=encode("x<|im_end|>"),
        message=Message.assistant(None, tool_calls=[call]),
        finish_reason="tool_calls",
    )
    transcript.append(*results)
    prompt = transcript.prompt_for_turn(delta, closing=await template.closing())
    assert prompt.spans[0] == prompt.spans[1]


async def test_non_append_stable_template_raises_a_clear_error():
    template = ChatTemplate(LocalRenderer(counting))
    with pytest.raises(TemplateError, match="not append-stable"):
        await template.delta([Message.user("more")], last=Message.assistant("x"))


async def test_anchor_renders_are_cached_per_tools():
    renderer = LocalRenderer()
    template = ChatTemplate(renderer)
    await template.delta([Message.user("a")], last=Message.assistant("x"), tools=TOOLS)
    calls = renderer.calls
    await template.delta([Message.user("b")], last=Message.assistant("y"), tools=TOOLS)
    assert renderer.calls == calls + 1  # only the new messages' render
    await template.delta([Message.user("b")], last=Message.assistant("y"), tools=None)
    assert renderer.calls > calls + 2  # a new tools list renders its own anchors


async def test_concurrent_first_uses_share_one_anchor_computation():
    renderer = LocalRenderer()
    template = ChatTemplate(renderer)
    await asyncio.gather(*(template.info() for _ in range(20)))
    assert renderer.calls == 4


async def test_failed_anchor_render_is_not_cached():
    class Flaky(LocalRenderer):
        fail = True

        async def render(self, messages, *, tools, add_generation_prompt):
            if self.fail:
                raise RuntimeError("server restarting")
            return await super().render(
                messages, tools=tools, add_generation_prompt=add_generation_prompt
            )

    renderer = Flaky()
    template = ChatTemplate(renderer)
    with pytest.raises(RuntimeError):
        await template.info()
    renderer.fail = False
    assert decode((await template.info()).closing) == "<|im_end|>\n"


async def test_tools_change_the_rendered_prefix_not_the_delta():
    template = ChatTemplate(LocalRenderer())
    with_tools = await template.delta([Message.user("q")], last=Message.assistant("a"), tools=TOOLS)
    without = await template.delta([Message.user("q")], last=Message.assistant("a"), tools=None)
    assert with_tools.token_ids == without.token_ids


async def test_server_renderer_posts_vllm_tokenize_chat_shape():
    seen = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx2.Response(200, json={"count": 3, "max_model_len": 8192, "tokens": [1, 2, 3]})

    async with httpx2.AsyncClient(transport=httpx2.MockTransport(handler)) as client:
        renderer = ServerRenderer(HttpxPoster(client), "http://p:8000/", model="m")
        assert await renderer.render([USER], tools=TOOLS, add_generation_prompt=True) == [1, 2, 3]
    path, body = seen[0]
    assert path == "/tokenize"
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "add_generation_prompt": True,
        "add_special_tokens": False,
        "tools": TOOLS,
    }


@pytest.mark.parametrize(
    "answer", [{"tokens": "nope"}, {"count": 1}, {"tokens": [1, "2"]}, [1, 2], {"tokens": [True]}]
)
async def test_server_renderer_rejects_malformed_answers(answer):
    transport = httpx2.MockTransport(lambda request: httpx2.Response(200, json=answer))
    async with httpx2.AsyncClient(transport=transport) as client:
        renderer = ServerRenderer(HttpxPoster(client), "http://p:8000", model="m")
        with pytest.raises(MalformedResponseError):
            await renderer.render([USER], tools=None, add_generation_prompt=True)


def test_tools_key_ignores_key_order():
    a = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    b = [{"function": {"parameters": {}, "name": "f"}, "type": "function"}]
    assert tools_key(a) == tools_key(b) != tools_key(None) == tools_key([]) == ""
