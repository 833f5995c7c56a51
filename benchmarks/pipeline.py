"""Pipeline runtime benchmark: gloo ranks on CPU, one thread each, a stack of Linear+GELU blocks
(F, I and W are one GEMM each, so their costs are alike), m microbatches.

Prints `name: value` lines:
- split backward cost on one stage: F, fused B, our I and W (SplitLinear), PyTorch's graph-surgery
  I and W, and `split_overhead` = (I + W) / fused B for both (median of per-repetition ratios);
- step time (median of paired rounds) of our 1f1b, zb-h1, zb-v and of PyTorch's Schedule1F1B and
  ScheduleZBVZeroBubble on the same model; `zb_h1_over_1f1b` etc. (median of per-round ratios), on
  2 ranks and again on 4 (keys ending `_p4`; 4 single-thread ranks on a 2-core machine share cores,
  so the 4-rank figures measure contention as much as bubbles);
- per rank, the measured idle fraction of each of our schedules next to `simulate()`'s prediction
  from the measured per-action costs, and the peak saved-activation bytes next to the prediction
  (simulator's M_B model, and an exact replay of the measured per-stage deltas);
- `ds_over_torch_step`: a whole training step (schedule + clip by the global norm + AdamW) with a
  DeepSpeed ZeRO engine per stage over the same schedule and model, divided by the same step with
  plain PyTorch AdamW (median of paired rounds, 2 ranks), and `ds_vs_torch_weight_maxdiff` after
  one step of each from the same weights.

Run: python benchmarks/pipeline.py [--rounds 11] [--microbatches 8] [--ranks 2,4]  (noisy on a shared machine)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

OURS = ("1f1b", "zb-h1", "zb-v")
THEIRS = ("torch-1f1b", "torch-zbv")
# Large allocations otherwise go through mmap/munmap each time (page faults on every GEMM output).
MALLOC_TUNING = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def _layers(args, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(args.hidden, args.hidden, bias=False), nn.GELU()) for _ in range(args.layers)]


def _stages(args, stage_ids, num_stages: int) -> dict[int, nn.Module]:
    layers = _layers(args)
    per = args.layers // num_stages
    return {s: nn.Sequential(*layers[s * per:(s + 1) * per]) for s in stage_ids}


def _median(xs) -> float:
    return statistics.median(xs)


# -- split backward on one stage (one process) --------------------------------------------------

def _split_worker(rank: int, args, queue) -> None:
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    from anytime.pipeline.splitgrad import WeightGradStore, convert_linears

    torch.set_num_threads(1)
    layers = args.layers // 2
    fused = nn.Sequential(*_layers(args)[:layers])
    theirs = nn.Sequential(*_layers(args)[:layers])
    ours, store = nn.Sequential(*_layers(args)[:layers]), WeightGradStore()
    convert_linears(ours, store)
    times = defaultdict(list)
    for rep in range(args.split_reps + 3):
        x = torch.randn(args.rows, args.hidden, requires_grad=True)
        g = torch.randn(args.rows, args.hidden)
        t0 = time.perf_counter()
        out = fused(x)
        t1 = time.perf_counter()
        out.backward(g)
        t2 = time.perf_counter()
        with store.recording(rep):
            out = ours(x)
        t3 = time.perf_counter()
        with store.deferring():
            out.backward(g)
        t4 = time.perf_counter()
        store.flush(rep)
        t5 = time.perf_counter()
        out = theirs(x)
        t6 = time.perf_counter()
        _, groups = stage_backward_input([out], [g], [x], theirs.parameters())
        t7 = time.perf_counter()
        stage_backward_weight(theirs.parameters(), groups)
        t8 = time.perf_counter()
        if rep >= 3:
            for k, v in {"F": t1 - t0, "B": t2 - t1, "I": t4 - t3, "W": t5 - t4,
                         "torch_I": t7 - t6, "torch_W": t8 - t7}.items():
                times[k].append(v)
            # Per-repetition ratios: the three variants run back to back, so a noisy neighbour
            # slows all of them alike.
            times["ratio"].append((t5 - t3) / (t2 - t1))
            times["torch_ratio"].append((t8 - t6) / (t2 - t1))
        for m in (fused, ours, theirs):
            m.zero_grad(set_to_none=True)
    queue.put({k: _median(v) for k, v in times.items()})


# -- pipelined steps on 2 ranks -----------------------------------------------------------------

class _Runner:
    """Builds every variant on this rank and runs one step of any of them."""

    def __init__(self, args, rank: int, world: int) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleZBVZeroBubble,
        )

        from anytime.pipeline.runtime import PipelineExecutor
        from anytime.pipeline.schedule import build_schedule

        self.args, self.rank, self.world = args, rank, world
        m = args.microbatches
        self.x = torch.randn(m * args.rows, args.hidden, generator=torch.Generator().manual_seed(1))
        self.schedules, self.executors, self.modules = {}, {}, {}
        for name in OURS:
            sched = build_schedule(name, world, m)
            mine = [s for s, r in enumerate(sched.placement) if r == rank]
            stages = _stages(args, mine, sched.stages)
            self.schedules[name] = sched
            self.executors[name] = PipelineExecutor(stages, sched, prefetch=args.prefetch)
            self.modules[name] = list(stages.values())
        def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return out.pow(2).mean()

        stages = _stages(args, [rank], world)
        st = PipelineStage(stages[rank], rank, world, torch.device("cpu"))
        self.torch_1f1b = Schedule1F1B(st, m, loss_fn=loss)
        self.modules["torch-1f1b"] = list(stages.values())
        ids = [rank, 2 * world - 1 - rank]
        stages = _stages(args, ids, 2 * world)
        sts = [PipelineStage(stages[s], s, 2 * world, torch.device("cpu")) for s in ids]
        self.torch_zbv = ScheduleZBVZeroBubble(sts, m, loss_fn=loss)
        self.modules["torch-zbv"] = list(stages.values())
        self.target = torch.zeros(m * args.rows, args.hidden)

    def step(self, name: str):
        a, m = self.args, self.args.microbatches
        if name in OURS:
            return self.executors[name].train_step(
                lambda j: self.x[j * a.rows:(j + 1) * a.rows], lambda out, j: out.pow(2).mean(),
                ((a.rows, a.hidden), torch.float32), loss_scale=1.0 / m, timeline=True)
        if name == "torch-1f1b":
            if self.rank == 0:
                self.torch_1f1b.step(self.x)
            elif self.rank == self.world - 1:
                self.torch_1f1b.step(target=self.target)
            else:
                self.torch_1f1b.step()
        else:  # rank 0 holds the first and the last stage in the V placement
            if self.rank == 0:
                self.torch_zbv.step(self.x, target=self.target)
            else:
                self.torch_zbv.step()
        return None

    def zero(self, name: str) -> None:
        for module in self.modules[name]:
            module.zero_grad(set_to_none=True)

    def grads(self, name: str) -> list[torch.Tensor]:
        return [p.grad.clone() for module in self.modules[name] for p in module.parameters()]


def _p2p_latency(rank: int, args, reps: int = 50) -> float:
    buf = torch.zeros(args.rows, args.hidden)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return (time.perf_counter() - t0) / (2 * reps)


def _stage_memory(executor, stage: int, args) -> tuple[int, int]:
    """(M_B, M_W) in bytes for one microbatch of one stage, measured with the executor's own hooks."""
    x = torch.randn(args.rows, args.hidden, requires_grad=True)
    key = ("probe", stage)
    with executor.store.recording(key), executor.saved.forward(key):
        out = executor.stages[stage](x)
    m_b = executor.saved.device_bytes(key)
    with executor.store.deferring():
        out.pow(2).mean().backward()
    executor.saved.release(key)
    m_w = executor.store.pending_bytes(key)
    executor.store.flush(key)
    for module in executor.stages.values():
        module.zero_grad(set_to_none=True)
    return m_b, m_w


def _replay_peak(actions, m_b: dict, m_w: dict) -> float:
    delta = {"F": lambda s: m_b[s], "I": lambda s: m_w[s] - m_b[s], "W": lambda s: -m_w[s], "B": lambda s: -m_b[s]}
    live = peak = 0.0
    for a in actions:
        live += delta[a.kind](a.stage)
        peak = max(peak, live)
    return peak


def _step_worker(rank: int, world: int, init_file: str, args, queue) -> None:
    from anytime.analysis.schedule_sim import simulate
    from anytime.pipeline.schedule import Action, StageCosts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    runner = _Runner(args, rank, world)
    out: dict[str, float] = {}
    # Same math check: our 1F1B and PyTorch's produce the same gradients from the same weights.
    runner.step("1f1b")
    runner.step("torch-1f1b")
    diff = max(float((a - b).abs().max()) for a, b in zip(runner.grads("1f1b"), runner.grads("torch-1f1b")))
    for name in OURS + THEIRS:
        runner.zero(name)
    variants = list(OURS + THEIRS)
    times: dict[str, list[float]] = defaultdict(list)
    busy: dict[str, list[list[float]]] = defaultdict(list)
    durations: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    peaks: dict[str, int] = {}
    for rnd in range(args.warmup + args.rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            stats = runner.step(name)
            local = time.perf_counter() - t0
            t = torch.tensor([local])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            runner.zero(name)
            if rnd < args.warmup:
                continue
            times[name].append(float(t))
            if stats is not None:
                b = [torch.zeros(1) for _ in range(world)]
                dist.all_gather(b, torch.tensor([stats.busy]))
                busy[name].append([1.0 - float(x) / float(t) for x in b])
                peaks[name] = max(peaks.get(name, 0), stats.peak_saved_bytes)
                for act, start, end in stats.timeline:
                    a = Action.parse(act)
                    durations[(name, a.stage, a.kind)].append(end - start)
    comm = _p2p_latency(rank, args)
    # Gather per-action medians and memory probes from both ranks.
    mine = {k: _median(v) for k, v in durations.items()}
    mem = {name: {s: _stage_memory(runner.executors[name], s, args) for s in runner.executors[name].stages}
           for name in OURS}
    gathered = [None] * world
    dist.all_gather_object(gathered, (mine, mem, peaks, comm))
    if rank == 0:
        med = {}
        mems: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
        for d, mm, _, _ in gathered:
            med.update(d)
            for name, per in mm.items():
                mems[name].update(per)
        comm = _median([g[3] for g in gathered])
        out["grad_maxdiff_ours_vs_torch_1f1b"] = diff
        out["p2p_latency_ms"] = 1e3 * comm
        for name in variants:
            out[f"step_ms_{name.replace('-', '_')}"] = 1e3 * _median(times[name])
        base = times["1f1b"]
        for name in ("zb-h1", "zb-v", "torch-1f1b", "torch-zbv"):
            ratio = _median([a / b for a, b in zip(times[name], base)])
            out[f"{name.replace('-', '_')}_over_1f1b"] = ratio
        out["torch_zbv_over_torch_1f1b"] = _median([a / b for a, b in zip(times["torch-zbv"], times["torch-1f1b"])])
        for name in OURS:
            sched = runner.schedules[name]
            v = sched.chunks
            costs = []
            for s in range(sched.stages):
                f = med[(name, s, "F")]
                if (name, s, "I") in med:
                    b, w = med[(name, s, "I")], med[(name, s, "W")]
                else:
                    b = w = med[(name, s, "B")] / 2
                costs.append(StageCosts(f=f * v, b=b * v, w=w * v, comm=comm))
            m_b = {s: mems[name][s][0] for s in range(sched.stages)}
            m_w = {s: mems[name][s][1] for s in range(sched.stages)}
            frac = min(1.0, sum(m_w.values()) / sum(m_b.values()))
            sim = simulate(sched, costs, w_mem_fraction=frac)
            tag = name.replace("-", "_")
            out[f"sim_step_ms_{tag}"] = 1e3 * sim.makespan
            out[f"w_mem_fraction_{tag}"] = sum(m_w.values()) / sum(m_b.values())
            for r in range(world):
                idle = [row[r] for row in busy[name]]
                out[f"idle_{tag}_rank{r}"] = _median(idle)
                out[f"idle_{tag}_rank{r}_sim"] = sim.idle[r] / sim.makespan
                full_stage = sum(m_b[s] for s in range(sched.stages) if sched.placement[s] == r)
                out[f"saved_bytes_{tag}_rank{r}"] = gathered[r][2][name]
                out[f"saved_bytes_{tag}_rank{r}_sim"] = sim.peak_memory[r] * full_stage
                out[f"saved_bytes_{tag}_rank{r}_replay"] = _replay_peak(sched.actions[r], m_b, m_w)
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


# -- DeepSpeed vs plain AdamW on the same schedule ------------------------------------------------

def _ds_worker(rank: int, world: int, init_file: str, args, queue) -> None:
    """One executor per variant over the same stages and weights: `torch` steps PyTorch AdamW after a
    blocking global-norm clip (`PostValidator` disabled), `deepspeed` a ZeRO engine per stage (its
    mpu makes the clip norm global too). Paired rounds, median ratio."""
    from anytime.config import LearnerConfig
    from anytime.learner.deepspeed_learner import initialize_engine
    from anytime.learner.deepspeed_stage import MeshMPU
    from anytime.learner.mesh import build_mesh
    from anytime.pipeline.postvalidate import PostValidator
    from anytime.pipeline.runtime import PipelineExecutor
    from anytime.pipeline.schedule import build_schedule

    os.environ["LOCAL_RANK"] = str(rank)  # DeepSpeed expects a launcher's variables
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = build_mesh(world)  # every rank a stage, one replica
    m, a = args.microbatches, args
    sched = build_schedule(args.ds_schedule, world, m)
    mine = [s for s, r in enumerate(sched.placement) if r == rank]
    cfg = LearnerConfig(backend="deepspeed", lr=1e-4, weight_decay=0.0, grad_clip=1.0, zero_stage=args.ds_zero_stage)
    x = torch.randn(m * a.rows, a.hidden, generator=torch.Generator().manual_seed(1))
    steps, modules = {}, {}
    for name in ("torch", "deepspeed"):
        stages = _stages(args, mine, sched.stages)
        executor = PipelineExecutor(stages, sched, group=mesh.pp_group, prefetch=args.prefetch)
        module = nn.ModuleDict({str(s): mod for s, mod in stages.items()})
        params = list(module.parameters())
        modules[name] = module

        def run(executor=executor) -> None:
            executor.train_step(lambda j: x[j * a.rows:(j + 1) * a.rows], lambda out, j: out.pow(2).mean(),
                                ((a.rows, a.hidden), torch.float32), loss_scale=1.0 / m)
        if name == "torch":
            opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
            validator = PostValidator(opt, params, max_grad_norm=cfg.grad_clip, group=mesh.pp_group, enabled=False)

            def step(run=run, validator=validator) -> None:
                run()
                validator.step()
        else:
            engine, _, _ = initialize_engine(module, params, cfg, 10**6, zero_stage=cfg.zero_stage,
                                             mpu=MeshMPU(mesh.pp_group, mesh.dp_group))

            def step(run=run, engine=engine) -> None:
                with engine.coalesce_grad_reduction():
                    run()
                engine.step()
        steps[name] = step
    for name in steps:  # one step each from the same weights: the same update
        steps[name]()
    diff = max(float((p - q).abs().max()) for p, q in zip(modules["torch"].parameters(),
                                                          modules["deepspeed"].parameters()))
    times: dict[str, list[float]] = defaultdict(list)
    for rnd in range(args.warmup + args.rounds):
        for name in (("torch", "deepspeed") if rnd % 2 else ("deepspeed", "torch")):
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rnd >= args.warmup:
                times[name].append(float(t))
    diff_t = torch.tensor([diff])
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"ds_vs_torch_weight_maxdiff": float(diff_t), "step_ms_torch_adamw": 1e3 * _median(times["torch"]),
                   "step_ms_deepspeed": 1e3 * _median(times["deepspeed"]),
                   "ds_over_torch_step": _median([d / t for d, t in zip(times["deepspeed"], times["torch"])])})
    dist.barrier()
    dist.destroy_process_group()


def _spawn(worker, ranks: int, args, queue) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(ranks, os.path.join(tmp, "store"), args, queue), nprocs=ranks,
                           start_method="spawn")
    return queue.get()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=128, help="rows per microbatch")
    parser.add_argument("--layers", type=int, default=8, help="Linear+GELU blocks in the whole model")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--split-reps", type=int, default=40)
    parser.add_argument("--prefetch", type=int, default=2, help="actions ahead to post receives")
    parser.add_argument("--no-malloc-tuning", action="store_true")
    parser.add_argument("--ranks", default="2,4", help="pipeline ranks of the schedule comparison (2 first)")
    parser.add_argument("--ds-schedule", default="zb-h1", help="schedule of the DeepSpeed-vs-AdamW comparison")
    parser.add_argument("--ds-zero-stage", type=int, default=1, choices=(1, 2))
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed-vs-AdamW comparison")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    if ranks[0] != 2 or any(args.layers % (2 * r) for r in ranks):
        parser.error("--ranks must start with 2, and --layers be a multiple of 2 × every rank count "
                     "(zb-v holds two chunks per rank)")
    if not args.no_malloc_tuning:
        os.environ["GLIBC_TUNABLES"] = MALLOC_TUNING  # read by the spawned processes at start
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    results: dict[str, float] = {"malloc_tuned": float(not args.no_malloc_tuning)}
    mp.start_processes(_split_worker, args=(args, queue), nprocs=1, start_method="spawn")
    split = queue.get()
    results.update({f"stage_{k}_ms": 1e3 * v for k, v in split.items() if "ratio" not in k})
    results["split_overhead"] = split["ratio"]
    results["torch_split_overhead"] = split["torch_ratio"]
    # Ideal: the whole model's work split evenly over the ranks with no bubble (one stage of the
    # split benchmark = half the model).
    for world in ranks:
        suffix = "" if world == 2 else f"_p{world}"
        measured = _spawn(_step_worker, world, args, queue)
        results.update({f"{k}{suffix}": v for k, v in measured.items()})
        results[f"ideal_step_ms{suffix}"] = ideal = 1e3 * args.microbatches * (split["F"] + split["B"]) * 2 / world
        for name in OURS + THEIRS:
            key = name.replace("-", "_")
            results[f"{key}_over_ideal{suffix}"] = results[f"step_ms_{key}{suffix}"] / ideal
    if not args.no_deepspeed:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is not None:
            results.update(_spawn(_ds_worker, 2, args, queue))
    for k, v in results.items():
        print(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}")
    return results


if __name__ == "__main__":
    main()
