"""Parent and subagent turns apart: a replay with subagents, summarized by role.

A subagent's turns are not a parent's: its first turn opens with what its siblings opened with
(their common system prompt and tools, 95-99% of it in Claude Code's Explore subagents), and
nothing of its parent's, while a parent's later turns extend its own history. The report keeps
three groups apart, per mode:

* ``parent_turns_2_plus``: a parent's turns 2 and later; their ideal is the SDK's (the previous
  turn's prompt and output, less one);
* ``subagent_first_turns``: a subagent's turn 1; its ideal is what it can find cached from an
  earlier sibling: the system prompt's tokens plus those of the longest text its first message
  shares with the first message of a session of its conversation that started earlier
  (``SessionOrigin.shared_chars``; chat-template tokens not counted). TTFT is over every
  subagent's first turn, reuse/ideal over those that have such a sibling;
* ``subagent_turns_2_plus``: a subagent's turns 2 and later, ideal as the parent's.

Each group gives ``turns`` (successful turns counted), ``ttft_p50_ms``, ``ttft_p90_ms`` and
``reuse_vs_ideal`` (reused tokens over the ideal, summed over turns with a non-zero ideal), and
``role_ratios`` gives agentkv's TTFT p50 over each reference mode's, per group. The report's
``sessions`` lists each session's conversation, role, agent id, subagent type and that first-turn
ideal, so a saved report can be drawn again without the trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentkv.bench._config import Mode
from agentkv.bench._report import percentile
from agentkv.bench._samples import TurnSample
from agentkv.bench._workload import Workload

__all__ = [
    "ROLE_GROUPS",
    "role_lines",
    "role_ratios",
    "role_report",
    "role_summaries",
    "session_roles",
]

ROLE_GROUPS = ("parent_turns_2_plus", "subagent_first_turns", "subagent_turns_2_plus")
_LABELS = {
    "parent_turns_2_plus": "parent turns >= 2",
    "subagent_first_turns": "subagent turn 1",
    "subagent_turns_2_plus": "subagent turns >= 2",
}
_REFERENCES = (Mode.LIMIT.value, Mode.DISAGG.value, Mode.AFFINITY.value)


def session_roles(workload: Workload, first_turn_ideal: Sequence[int]) -> list[dict[str, Any]]:
    """The report's ``sessions``: each replayed session's origin and its first turn's ideal
    reuse (``first_turn_ideal[i]`` for session ``i``)."""
    out = []
    for script in workload.sessions:
        origin = script.origin
        out.append({
            "session": script.index,
            "conversation": None if origin is None else origin.conversation,
            "role": "parent" if origin is None else origin.role,
            "agent_id": None if origin is None else origin.agent_id,
            "subagent_type": None if origin is None else origin.subagent_type,
            "start_s": round(script.start_s, 3),
            "first_turn_ideal_reused_tokens": first_turn_ideal[script.index],
        })
    return out


def _group(
    samples: Iterable[TurnSample], ideal: Callable[[TurnSample], int]
) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft_s * 1000.0 for s in ok]
    wanted = sum(ideal(s) for s in ok)
    reused = sum(s.reused_tokens for s in ok if ideal(s))
    return {
        "turns": len(ok),
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 3) if ttfts else None,
        "ttft_p90_ms": round(percentile(ttfts, 0.9), 3) if ttfts else None,
        "reuse_vs_ideal": round(reused / wanted, 5) if wanted else None,
    }


def role_summaries(
    samples: Iterable[TurnSample], sessions: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per mode, the three groups' summaries (see the module docstring)."""
    role = {int(s["session"]): str(s["role"]) for s in sessions}
    first = {int(s["session"]): int(s["first_turn_ideal_reused_tokens"]) for s in sessions}
    by_mode: dict[str, list[TurnSample]] = {}
    for sample in samples:
        by_mode.setdefault(sample.mode.value, []).append(sample)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode, mine in by_mode.items():
        parent = [s for s in mine if role.get(s.session) != "subagent"]
        sub = [s for s in mine if role.get(s.session) == "subagent"]
        out[mode] = {
            "parent_turns_2_plus": _group(
                (s for s in parent if s.turn >= 2), lambda s: s.ideal_reused_tokens),
            "subagent_first_turns": _group(
                (s for s in sub if s.turn == 1), lambda s: first.get(s.session, 0)),
            "subagent_turns_2_plus": _group(
                (s for s in sub if s.turn >= 2), lambda s: s.ideal_reused_tokens),
        }
    return out


def role_ratios(roles: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """agentkv's TTFT p50 over each reference mode's that ran (limit, disagg, affinity), per
    group: ``{"agentkv_vs_limit": {"parent_turns_2_plus": 1.2, ...}, ...}``."""
    ours = roles.get(Mode.AGENTKV.value)
    if ours is None:
        return {}
    out: dict[str, Any] = {}
    for other in _REFERENCES:
        if other not in roles:
            continue
        row = {}
        for group in ROLE_GROUPS:
            a, b = ours[group]["ttft_p50_ms"], roles[other][group]["ttft_p50_ms"]
            row[group] = None if not a or not b else round(a / b, 3)
        out[f"{Mode.AGENTKV.value}_vs_{other}"] = row
    return out


def role_report(
    modes: Sequence[Mode], samples: Iterable[TurnSample], sessions: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The report's ``sessions``, ``roles`` (in the run's mode order) and ``role_ratios``."""
    summaries = role_summaries(samples, sessions)
    roles: dict[str, Any] = {m.value: summaries[m.value] for m in modes if m.value in summaries}
    return {"sessions": list(sessions), "roles": roles, "role_ratios": role_ratios(roles)}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def role_lines(report: Mapping[str, Any]) -> list[str]:
    """The printed table of a report's ``roles`` (none for a report without them)."""
    roles = report.get("roles")
    if not roles:
        return []
    lines = ["by role     turns                 n  TTFT p50 (ms)  TTFT p90 (ms)  reuse/ideal"]
    for mode, groups in roles.items():
        for group in ROLE_GROUPS:
            g = groups[group]
            reuse = g["reuse_vs_ideal"]
            lines.append(
                f"{mode:<10}  {_LABELS[group]:<20}  {g['turns']:>2}  {_ms(g['ttft_p50_ms']):>13}  "
                f"{_ms(g['ttft_p90_ms']):>13}  "
                f"{'-' if reuse is None else f'{100 * reuse:.1f}%':>11}"
            )
    for name, row in report.get("role_ratios", {}).items():
        parts = ", ".join(
            f"{_LABELS[group]} {'-' if row[group] is None else f'{row[group]:.2f}'}"
            for group in ROLE_GROUPS
        )
        lines.append(f"{name.replace('_vs_', ' / ')} TTFT p50 by role: {parts}")
    return lines
