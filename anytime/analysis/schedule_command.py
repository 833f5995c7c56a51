"""``anytime schedule``: show one pipeline schedule, or compare all of them, under a cost model.

    anytime schedule zb-h1 -p 4 -m 12 [--cost-f 1 --cost-b 1 --cost-w 1 --cost-comm 0] [--json]
    anytime schedule zb-v -p 4 -m 12 --plot zbv.png --trace zbv.json
    anytime schedule compare -p 4 -m 12

Also runnable without the main CLI: ``python -m anytime.analysis.schedule_command ...``.
"""

from __future__ import annotations

import argparse
import json
import sys

from anytime.analysis.schedule_sim import SimResult, simulate
from anytime.pipeline import SCHEDULES
from anytime.pipeline.schedule import StageCosts, build_schedule

_TEXT_TIMELINE_MAX_WIDTH = 240


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``schedule`` subcommand's arguments on ``parser``."""
    parser.add_argument(
        "name",
        metavar="NAME",
        choices=(*SCHEDULES.names(), "compare"),
        help=f"schedule to show ({', '.join(SCHEDULES.names())}) or 'compare' for a table of all",
    )
    parser.add_argument("-p", "--ranks", type=int, required=True, help="pipeline ranks (devices)")
    parser.add_argument("-m", "--microbatches", type=int, required=True, help="microbatches per iteration")
    parser.add_argument(
        "-v", "--chunks", type=int, default=None,
        help="model chunks per rank (default: 1; 2 for interleaved-1f1b and the V schedules)",
    )
    parser.add_argument("--cost-f", type=float, default=1.0, help="forward time of one full stage")
    parser.add_argument("--cost-b", type=float, default=1.0, help="input-backward (I) time of one full stage")
    parser.add_argument("--cost-w", type=float, default=1.0, help="weight-backward (W) time of one full stage")
    parser.add_argument("--cost-comm", type=float, default=0.0, help="latency of one cross-rank send")
    parser.add_argument(
        "--mem-limit", type=float, default=None,
        help="activation memory per rank in M_B for zb-auto (default p) and zb-h2 (default 2p-1)",
    )
    parser.add_argument(
        "--w-mem-fraction", type=float, default=None,
        help="M_W/M_B, share of a microbatch's activations a pending W keeps (default 32/34)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list for compare)")
    parser.add_argument("--plot", metavar="PNG", default=None, help="write a timeline PNG")
    parser.add_argument("--trace", metavar="JSON", default=None, help="write a Chrome/Perfetto trace")


def run(args: argparse.Namespace) -> int:
    """Execute ``anytime schedule``; returns the process exit code."""
    try:
        costs = StageCosts(args.cost_f, args.cost_b, args.cost_w, args.cost_comm)
        if args.name == "compare":
            if args.plot or args.trace:
                raise ValueError("--plot and --trace need one schedule NAME, not 'compare'")
            return _compare(args, costs)
        result = _simulate_one(args.name, args, costs, args.chunks)
    except ValueError as err:
        print(f"anytime schedule: error: {err}", file=sys.stderr)
        return 2
    if args.plot:
        from anytime.analysis.schedule_plot import plot_timeline

        plot_timeline(result, args.plot)
    if args.trace:
        result.write_chrome_trace(args.trace)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(_describe(result))
    return 0


def _simulate_one(name: str, args: argparse.Namespace, costs: StageCosts, chunks: int | None) -> SimResult:
    schedule = build_schedule(
        name, args.ranks, args.microbatches, chunks, costs,
        args.mem_limit if name in ("zb-auto", "zb-h2") else None,
        w_mem_fraction=args.w_mem_fraction,
    )
    return simulate(schedule, costs, w_mem_fraction=args.w_mem_fraction)


def _describe(result: SimResult) -> str:
    from anytime.analysis.schedule_plot import text_timeline

    s = result.schedule

    def fmt(xs) -> str:
        return "[" + ", ".join(f"{x:g}" for x in xs) + "]"

    lines = [
        f"schedule {s.name}: p={s.ranks} m={s.microbatches} v={s.chunks} placement={s.placement}",
        f"makespan     {result.makespan:g}",
        f"bubble rate  {result.bubble_rate:.4f}  (max rank idle / makespan)",
        f"idle         {fmt(round(x, 6) for x in result.idle)}",
        f"span idle    {fmt(round(x, 6) for x in result.span_idle)}  (gaps inside each rank's own span)",
        f"peak memory  {fmt(round(x, 4) for x in result.peak_memory)} M_B  (w_mem_fraction {result.w_mem_fraction:.4f})",
        f"p2p sends    {result.p2p_messages}",
    ]
    timeline = text_timeline(result)
    if timeline and len(timeline.splitlines()[0]) <= _TEXT_TIMELINE_MAX_WIDTH:
        lines += ["", "timeline (F forward, I input backward, W weight backward, B fused; lower case: 2nd chunk)",
                  timeline]
    return "\n".join(lines)


def _compare(args: argparse.Namespace, costs: StageCosts) -> int:
    rows: list[dict] = []
    for name in SCHEDULES.names():
        chunks = args.chunks if name == "interleaved-1f1b" else None
        try:
            res = _simulate_one(name, args, costs, chunks)
        except ValueError as err:
            rows.append({"schedule": name, "error": str(err)})
            continue
        rows.append(
            {
                "schedule": name,
                "chunks": res.schedule.chunks,
                "makespan": res.makespan,
                "bubble_rate": res.bubble_rate,
                "peak_memory": max(res.peak_memory),
                "span_idle": max(res.span_idle),
                "p2p_messages": res.p2p_messages,
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"p={args.ranks} m={args.microbatches} costs F={costs.f:g} I={costs.b:g} W={costs.w:g} comm={costs.comm:g}")
    header = f"{'schedule':<17} {'v':>2} {'makespan':>9} {'bubble':>7} {'peak M_B':>8} {'span idle':>9} {'p2p':>5}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if "error" in row:
            print(f"{row['schedule']:<17} n/a: {row['error']}")
            continue
        print(
            f"{row['schedule']:<17} {row['chunks']:>2} {row['makespan']:>9.2f} {row['bubble_rate']:>7.1%} "
            f"{row['peak_memory']:>8.2f} {row['span_idle']:>9.2f} {row['p2p_messages']:>5}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anytime schedule", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
