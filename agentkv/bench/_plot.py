"""The PNG: TTFT by turn, one line per mode (median over sessions, band from min to max).

matplotlib is imported here only (the ``bench`` extra), with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentkv import ConfigError
from agentkv.bench._report import median_by_turn

__all__ = ["STYLES", "plot_ttft", "style_of"]

# One colour and one marker per mode, none shared, so that every line can be told apart, in
# print and by a reader who does not see some colours (Okabe-Ito's palette, plus greys).
STYLES: dict[str, tuple[str, str]] = {
    "disagg": ("#D55E00", "s"),
    "affinity": ("#E69F00", "^"),
    "agentkv": ("#0072B2", "o"),
    "agentkv-decode": ("#56B4E9", "D"),
    "agentkv-auto": ("#CC79A7", "P"),
    "tier": ("#009E73", "v"),
    "oracle": ("#000000", "x"),
    "limit": ("#555555", "*"),
    "aggregated": ("#999999", "h"),
}
# A mode the table does not name (one added later) gets a colour and marker none above use.
_SPARE = (("#8C564B", "<"), ("#F0E442", ">"), ("#7F7F7F", "p"), ("#17BECF", "d"))


def style_of(mode: str, *, taken: set[tuple[str, str]] | None = None) -> tuple[str, str]:
    """The colour and marker of ``mode``'s line; a mode the table lacks gets a spare one that
    ``taken`` (the styles already drawn) does not hold."""
    known = STYLES.get(mode)
    if known is not None:
        return known
    used = set(STYLES.values()) | (taken or set())
    return next((spare for spare in _SPARE if spare not in used), _SPARE[-1])


def plot_ttft(report: Mapping[str, Any], path: str | Path, *, title: str | None = None) -> Path:
    """Write the TTFT-by-turn plot of ``report`` to ``path`` (PNG); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter
    except ImportError as exc:  # pragma: no cover - the bench extra installs it
        raise ConfigError("plotting needs matplotlib: pip install 'agentkv[bench]'") from exc

    config = report["config"]
    figure, axes = plt.subplots(figsize=(8.0, 4.8), dpi=120)
    taken: set[tuple[str, str]] = set()
    for mode, block in report["modes"].items():
        turns = [row["turn"] for row in block["turns"]]
        medians = median_by_turn(block)
        lows, highs = [], []
        for row in block["turns"]:
            values = [v for v in row["ttft_ms"] if v is not None]
            lows.append(min(values) / 1000.0 if values else float("nan"))
            highs.append(max(values) / 1000.0 if values else float("nan"))
        ys = [m / 1000.0 if m is not None else float("nan") for m in medians]
        color, marker = style_of(mode, taken=taken)
        taken.add((color, marker))
        axes.plot(turns, ys, marker=marker, label=mode, color=color)
        axes.fill_between(turns, lows, highs, alpha=0.15, color=color)
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    axes.tick_params(axis="y", which="minor", labelsize=7)
    axes.set_xlabel("turn")
    axes.set_ylabel("time to first token (s, log scale)")
    axes.set_xticks(range(1, int(config["turns"]) + 1))
    axes.grid(visible=True, which="both", alpha=0.3)
    axes.legend()
    sessions = int(config["sessions"])
    axes.set_title(title or (
        f"TTFT by turn: {sessions} session{'s' if sessions != 1 else ''} per mode, "
        f"{config['context_tokens']}-token context, {config['tool_tokens']}-token tool results"
    ), fontsize=10)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out)
    plt.close(figure)
    return out
