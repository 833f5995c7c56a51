"""Timeline pictures of a simulated schedule: a PNG (matplotlib, imported lazily) and plain text."""

from __future__ import annotations

import math
from pathlib import Path

from anytime.analysis.schedule_sim import SimResult

KIND_COLOURS = {"F": "#4C72B0", "I": "#DD8452", "W": "#55A868", "B": "#C44E52"}
KIND_LABELS = {"F": "F forward", "I": "I input backward", "W": "W weight backward", "B": "B fused backward"}


def text_timeline(result: SimResult, slot: float | None = None) -> str:
    """One line per rank, one character per ``slot`` time units (default: the shortest pass).

    A pass is drawn with its kind letter (lower case when it belongs to a rank's second or later
    chunk) at the slots it covers; '.' is idle.
    """
    if not result.timeline:
        return ""
    if slot is None:
        slot = min(t.end - t.start for t in result.timeline)
    width = int(math.ceil(result.makespan / slot - 1e-9))
    rows = []
    p = result.schedule.ranks
    for r in range(p):
        line = ["."] * width
        for t in result.rank_timeline(r):
            ch = t.action.kind if t.action.stage < p else t.action.kind.lower()
            lo = int(round(t.start / slot))
            hi = max(lo + 1, int(round(t.end / slot)))
            for x in range(lo, min(hi, width)):
                line[x] = ch
        rows.append(f"rank {r:>2} |" + "".join(line) + "|")
    return "\n".join(rows)


def plot_timeline(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG timeline: one row per rank, one box per pass coloured by kind (F/I/W/B),
    labelled with its microbatch; passes of a rank's second or later chunk are hatched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib is heavy
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sched = result.schedule
    p = sched.ranks
    span = max(result.makespan, 1e-9)
    fig = Figure(figsize=(min(24.0, max(8.0, span / 2.5)), 0.55 * p + 1.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shortest = min((t.end - t.start for t in result.timeline), default=1.0)
    for t in result.timeline:
        later_chunk = sched.placement.index(t.rank) != t.action.stage
        ax.broken_barh(
            [(t.start, t.end - t.start)],
            (t.rank - 0.4, 0.8),
            facecolors=KIND_COLOURS[t.action.kind],
            edgecolors="black",
            linewidth=0.4,
            hatch="//" if later_chunk else None,
        )
        if (t.end - t.start) / span > 0.008 and (t.end - t.start) >= shortest * 0.99:
            ax.text((t.start + t.end) / 2, t.rank, str(t.action.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xlabel("time (cost units)")
    kinds = [k for k in KIND_COLOURS if any(t.action.kind == k for t in result.timeline)]
    handles = [Patch(facecolor=KIND_COLOURS[k], edgecolor="black", label=KIND_LABELS[k]) for k in kinds]
    if sched.chunks > 1:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="second chunk"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    peak = max(result.peak_memory, default=0.0)
    ax.set_title(title or (f"{sched.name}: p={p}, m={sched.microbatches}, v={sched.chunks} | makespan "
                           f"{result.makespan:g}, bubble {result.bubble_rate:.1%}, peak {peak:.2f} M_B"), fontsize=10)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # leave a strip for the legend
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
