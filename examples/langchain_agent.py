"""A LangChain tool loop on the local pair through ``ChatAgentKV``: the same KV reuse as ``Agent``.

    pip install 'agentkv[langchain]'
    agentkv up
    python examples/langchain_agent.py [--cluster path/to/cluster.json]

LangChain re-sends the whole conversation on every call; ``ChatAgentKV`` lines it up with its
session, renders only the new messages, and each turn pulls the previous turn's KV from decode.
"""

import argparse
import os

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

import agentkv
from agentkv.integrations.langchain import ChatAgentKV


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


@tool
def subtract(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


TOOLS = {t.name: t for t in (add, multiply, subtract)}
# One worked example in the system prompt: small models copy its shape.
SYSTEM = """You are a careful calculator. Do one operation per step.
Example task: Compute (2 + 3) * 4 - 1.
Reply: [{"name":"add","arguments":{"a":2,"b":3}}]
Result: add(a=2, b=3) returned: 5
Reply: [{"name":"multiply","arguments":{"a":5,"b":4}}]
Result: multiply(a=5, b=4) returned: 20
Reply: [{"name":"subtract","arguments":{"a":20,"b":1}}]
Result: subtract(a=20, b=1) returned: 19
Reply: [{"name":"final_answer","arguments":{"answer":"19"}}]"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", default="Compute (17 + 25) * 3 - 4.")
    parser.add_argument(
        "--cluster", default=os.environ.get("AGENTKV_CLUSTER", ".agentkv/cluster.json")
    )
    parser.add_argument("--max-steps", type=int, default=6)
    args = parser.parse_args()
    with agentkv.Cluster.from_file(args.cluster) as cluster:
        llm = ChatAgentKV(
            cluster=cluster,
            max_tokens=96,
            tool_calling=agentkv.JsonToolCalling(max_calls=1),
        )
        tools = list(TOOLS.values())
        # The same tools (so the same prompt prefix) with different tool choices: a tool call
        # for the task's three operations, then the model's choice, the answer at the end.
        must_call = llm.bind_tools(tools, tool_choice="required")
        may_call = llm.bind_tools(tools)
        answer_now = llm.bind_tools(tools, tool_choice="final")
        messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(args.task)]
        for step in range(1, args.max_steps + 1):
            model = must_call if step <= 3 else may_call
            ai = (answer_now if step == args.max_steps else model).invoke(messages)
            stats = ai.response_metadata["agentkv"]
            print(
                f"turn {stats['turn']}: reused {stats['reused_tokens']} of "
                f"{stats['prompt_tokens']} (ideal {stats['ideal_reused_tokens']}, "
                f"{stats['handle_state']})"
            )
            messages.append(ai)
            if not ai.tool_calls:
                print("answer:", ai.content)
                break
            for call in ai.tool_calls:
                output = TOOLS[call["name"]].invoke(call["args"])
                print(f"  {call['name']}({call['args']}) -> {output}")
                messages.append(ToolMessage(str(output), tool_call_id=call["id"]))
        llm.close()


if __name__ == "__main__":
    main()
