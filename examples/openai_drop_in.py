"""A plain openai-SDK tool loop on agentkv: one changed line, and every turn after the first
reuses the conversation's KV.

    agentkv up                            # start the local pair (once)
    python examples/openai_drop_in.py     # or: python examples/openai_drop_in.py cluster.json

The loop is ordinary openai code: it re-sends the whole conversation each call and echoes the
model's tool calls back. ``agentkv.OpenAI`` maps each request onto the session named by
``session_id``, in-process (no proxy to run).
"""

import json
import os
import sys

import agentkv

cluster_file = (sys.argv[1:] or [os.environ.get("AGENTKV_CLUSTER", ".agentkv/cluster.json")])[0]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER = {"paris": "sunny, 21 C", "oslo": "snow, -3 C"}


def get_weather(city: str) -> str:
    return WEATHER.get(city.strip().lower(), "unknown")


# The one changed line; was: client = openai.OpenAI()
client = agentkv.OpenAI(cluster_file, session_id="weather-demo")

messages = [
    {
        "role": "system",
        "content": "You are a weather assistant. Call get_weather for every city you are asked "
        "about, then answer in one sentence.",
    },
    {"role": "user", "content": "What is the weather in Paris and in Oslo?"},
]
with client:
    for _ in range(4):
        reply = client.chat.completions.create(
            model=client.model, messages=messages, tools=TOOLS, max_tokens=128
        )
        message = reply.choices[0].message
        usage = reply.usage
        cached = (
            usage.prompt_tokens_details.cached_tokens
            if usage and usage.prompt_tokens_details
            else 0
        )
        print(f"prompt {usage.prompt_tokens if usage else 0} tokens, {cached} reused")
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content)
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            result = get_weather(str(args.get("city", "")))
            print(f"  {call.function.name}({args}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
