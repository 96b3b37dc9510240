"""A tool-using agent on the local pair: arithmetic with three tools, and what each turn reused.

    agentkv up
    python examples/tool_agent.py ["Compute (17 + 25) * 3 - 4."] [--cluster path/to/cluster.json]

Tools are typed functions; ``@agentkv.tool`` derives their JSON schema from the type hints and
docstrings. The default tool-calling protocol (``JsonToolCalling``) constrains the model's
replies to valid JSON tool calls with vLLM's structured outputs, so even SmolLM2-135M calls the
tools correctly; whether it computes well is another matter at 135M parameters.
"""

import argparse
import os

import agentkv


@agentkv.tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@agentkv.tool
def multiply(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


@agentkv.tool
def subtract(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


PROTOCOL = agentkv.JsonToolCalling(max_calls=1)  # one call per step
SYSTEM = "You are a careful calculator. Do one operation per step."
# One worked example as conversation turns: small models follow demonstrated turns far better
# than instructions.
EXAMPLE = PROTOCOL.example(
    "Compute (2 + 3) * 4 - 1.",
    [
        ("add", {"a": 2, "b": 3}, "5"),
        ("multiply", {"a": 5, "b": 4}, "20"),
        ("subtract", {"a": 20, "b": 1}, "19"),
    ],
    "19",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", default="Compute (17 + 25) * 3 - 4.")
    parser.add_argument(
        "--cluster", default=os.environ.get("AGENTKV_CLUSTER", ".agentkv/cluster.json")
    )
    args = parser.parse_args()
    with agentkv.Cluster.from_file(args.cluster) as cluster:
        agent = agentkv.Agent(
            cluster,
            tools=[add, multiply, subtract],
            system=SYSTEM,
            examples=EXAMPLE,
            min_tool_calls=3,  # the task has three operations; a 135M model may stop early
            max_steps=6,
            max_tokens=96,
            tool_calling=PROTOCOL,
        )
        for event in agent.stream(args.task):
            if isinstance(event, agentkv.ToolCallEvent):
                print(f"call   {event.call.name}({event.call.arguments})")
            elif isinstance(event, agentkv.ToolResultEvent):
                print(f"result {event.result.output}")
            elif isinstance(event, agentkv.RunResult):
                result = event
    print(f"answer: {result.answer} ({result.stop_reason}, {len(result.tool_results)} tool calls)")
    print("turn  prompt  reused  ideal  ttft_ms  handle")
    for t in result.turns:
        print(
            f"{t.turn:>4}  {t.prompt_tokens:>6}  {t.reused_tokens:>6}  "
            f"{t.ideal_reused_tokens:>5}  {t.ttft_ms:>7.0f}  {t.handle_state.value}"
        )


if __name__ == "__main__":
    main()
