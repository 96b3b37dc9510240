"""Agents on the real local pair: tool loops that reuse every turn, and the examples that run them.

Reuse is read from the prefill server's own usage (``cached_tokens``). The bar is the ideal
itself: the previous turn's prompt + output, less the last token (the local pair pulls whatever
prefill lacks, partial blocks included: ``kv_recompute_threshold`` 1).
"""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv import Cluster, HandleState, TurnStats
from agentkv.local._demo_agent import TASK, build_agent, run_agent_demo

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def assert_every_later_turn_reuses_the_ideal(turns: list[TurnStats]) -> None:
    assert len(turns) >= 2
    for previous, turn in itertools.pairwise(turns):
        ideal = previous.prompt_tokens + previous.generated_tokens - 1
        assert turn.ideal_reused_tokens == ideal
        assert turn.handle_state is HandleState.ATTACHED, turn.handle_reason
        assert turn.reused_tokens == ideal, turn


def test_the_tool_agent_completes_its_task_with_three_tool_calls_reusing_every_turn(
    cluster_file: Path,
) -> None:
    with Cluster.from_file(cluster_file) as cluster:
        run = build_agent(cluster).run(TASK)
    assert run.stop_reason == "answer"
    assert run.answer
    assert len(run.tool_results) >= 3
    # Structured outputs make every call well-formed: no argument errors, no unknown tools.
    assert all(result.ok for result in run.tool_results), run.tool_results
    assert all(step.error is None for step in run.steps)
    assert_every_later_turn_reuses_the_ideal(list(run.turns))


def test_a_langchain_tool_loop_reuses_every_turn_too(cluster_file: Path) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage

    from agentkv._agent.tool_calling import JsonToolCalling
    from agentkv.integrations.langchain import ChatAgentKV
    from agentkv.local._demo_agent import SYSTEM, add, multiply, subtract

    tools = {t.name: t for t in (add, multiply, subtract)}
    with Cluster.from_file(cluster_file) as cluster:
        llm = ChatAgentKV(cluster=cluster, max_tokens=96, tool_calling=JsonToolCalling(max_calls=1))
        must_call = llm.bind_tools(list(tools.values()), tool_choice="required")
        answer_now = llm.bind_tools(list(tools.values()), tool_choice="final")
        messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(TASK)]
        calls = 0
        for model in (must_call, must_call, must_call, answer_now):
            ai = model.invoke(messages)
            messages.append(ai)
            for call in ai.tool_calls:
                output = tools[call["name"]](**call["args"])
                messages.append(ToolMessage(str(output), tool_call_id=call["id"]))
                calls += 1
        assert llm.session is not None
        turns = list(llm.session.turns)
        llm.close()
    assert calls >= 3
    assert not ai.tool_calls
    assert isinstance(ai.content, str)
    assert ai.content
    assert_every_later_turn_reuses_the_ideal(turns)


def test_the_demo_prints_a_table_of_turns(cluster_file: Path) -> None:
    out = io.StringIO()
    assert run_agent_demo(cluster_file, out=out) == 0
    text = out.getvalue()
    assert "turn  prompt  reused" in text
    assert "answer:" in text


def _run_example(*args: str, cluster_file: Path) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "AGENTKV_CLUSTER": str(cluster_file)},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_quickstart_runs(cluster_file: Path) -> None:
    out = _run_example(
        str(EXAMPLES / "quickstart.py"), str(cluster_file), cluster_file=cluster_file
    )
    assert "turn 2 reused" in out


def test_the_tool_agent_example_runs(cluster_file: Path) -> None:
    out = _run_example(str(EXAMPLES / "tool_agent.py"), cluster_file=cluster_file)
    assert "answer:" in out
    assert out.count("call ") >= 3


def test_the_langchain_example_runs(cluster_file: Path) -> None:
    pytest.importorskip("langchain_core")
    out = _run_example(
        str(EXAMPLES / "langchain_agent.py"),
        "--cluster",
        str(cluster_file),
        cluster_file=cluster_file,
    )
    assert "answer:" in out


def test_the_notebook_runs(cluster_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("AGENTKV_CLUSTER", str(cluster_file))
    notebook = nbformat.read(EXAMPLES / "notebooks" / "agent.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    assert any("image/png" in out.get("data", {}) for out in outputs)
