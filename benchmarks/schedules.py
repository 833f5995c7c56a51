"""Simulated schedule quality: zb-auto against ZB-H1/ZB-H2 over a grid of unequal costs, and the
`anytime schedule compare` figures for p=4, m=12. Prints `name: value` lines.

    python benchmarks/schedules.py            # full grid (about a minute on 2 cores)
    python benchmarks/schedules.py --quick    # p in {2, 4} only

Ratios are makespan(zb-auto) / makespan(handcrafted): <= 1 means zb-auto is as fast or faster.
zb-auto gets the 1F1B memory (p M_B) against ZB-H1 and twice that against ZB-H2 ((2p-1) M_B).
"""

from __future__ import annotations

import argparse
import itertools
import time

from anytime.analysis.schedule_sim import simulate
from anytime.pipeline import SCHEDULES
from anytime.pipeline.schedule import StageCosts, build_schedule


def _makespan(name: str, p: int, m: int, costs: StageCosts, limit: float | None = None) -> float:
    return simulate(build_schedule(name, p, m, costs=costs, mem_limit=limit), costs).makespan


def grid(ps: tuple[int, ...]) -> None:
    costs = [
        StageCosts(1.0, b, w, c)
        for b, w, c in itertools.product((0.5, 1.0, 1.5, 2.0), (0.5, 1.0, 1.5), (0.0, 0.2, 0.5))
    ]
    worse = {"1p": [], "2p": []}
    ratios = {"1p": [], "2p": []}
    cases = 0
    for p in ps:
        for m in (p, 2 * p, 3 * p + 1):
            for c in costs:
                cases += 1
                tag = f"grid.p{p}.m{m}.I{c.b:g}.W{c.w:g}.comm{c.comm:g}"
                r1 = _makespan("zb-auto", p, m, c, p) / _makespan("zb-h1", p, m, c)
                r2 = _makespan("zb-auto", p, m, c, 2 * p) / _makespan("zb-h2", p, m, c)
                print(f"{tag}.auto1p_over_zbh1: {r1:.4f}")
                print(f"{tag}.auto2p_over_zbh2: {r2:.4f}")
                for key, r in (("1p", r1), ("2p", r2)):
                    ratios[key].append(r)
                    if r > 1 + 1e-9:
                        worse[key].append(tag)
    print(f"grid.cases: {cases}")
    for key, ref in (("1p", "zbh1"), ("2p", "zbh2")):
        print(f"grid.auto{key}_worse_than_{ref}: {len(worse[key])}")
        print(f"grid.auto{key}_over_{ref}.mean: {sum(ratios[key]) / len(ratios[key]):.4f}")
        print(f"grid.auto{key}_over_{ref}.max: {max(ratios[key]):.4f}")
        print(f"grid.auto{key}_over_{ref}.min: {min(ratios[key]):.4f}")
        comm0 = [t for t in worse[key] if t.endswith("comm0")]
        print(f"grid.auto{key}_worse_than_{ref}.with_comm0: {len(comm0)}")


def compare(p: int = 4, m: int = 12) -> None:
    for name in SCHEDULES.names():
        res = simulate(build_schedule(name, p, m))
        tag = f"compare.p{p}.m{m}.{name}"
        print(f"{tag}.makespan: {res.makespan:g}")
        print(f"{tag}.bubble_rate: {res.bubble_rate:.4f}")
        print(f"{tag}.peak_memory_mb: {max(res.peak_memory):.4f}")
        print(f"{tag}.span_idle: {max(res.span_idle):g}")
        print(f"{tag}.p2p_messages: {res.p2p_messages}")


def timing() -> None:
    for p, m in ((4, 12), (8, 32)):
        t0 = time.perf_counter()
        build_schedule("zb-auto", p, m, costs=StageCosts(1.0, 1.5, 0.5, 0.1))
        print(f"zb_auto.build_seconds.p{p}.m{m}: {time.perf_counter() - t0:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="grid over p in {2, 4} only")
    args = parser.parse_args()
    compare()
    timing()
    grid((2, 4) if args.quick else (2, 4, 8))


if __name__ == "__main__":
    main()
