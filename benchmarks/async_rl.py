"""Asynchronous (locked and in-flight staleness) against lock-step training on this machine, the
quickstart's RL workload, and the step-timeline simulator's prediction beside each measurement.

Four runs of `anytime train` (same model, recipe and steps):
  - lockstep_both_cores: today's lock-step, the in-process engine and the learner each using every core
    in turn (trainer.num_threads = all cores);
  - lockstep_split: lock-step with the rollout worker in a Ray actor pinned to the last core and the
    learner pinned to the others (each phase waits for the other);
  - locked_k1_split: the same split with `rollout.max_staleness: 1` (the next batch rolls out while the
    learner updates);
  - inflight_k2_split: the same split with `rollout.staleness_mode: inflight`, `max_staleness: 2` (the
    actor takes each new version between two decoding steps).
`--engine vllm` runs all four on the vLLM engine instead of transformers (in flight, vLLM pauses with
its requests kept, loads, relabels the weight version and resumes between two engine steps);
`--vllm-frontend async` drives it through vLLM's AsyncLLM (its engine core in a process of its own,
paused by `pause_generation` wherever it is when a version arrives).
The simulator (`anytime.analysis.timeline`) is calibrated on the lock-step split run's measured phases
(rollout = gen + summaries + reward on the worker, learner = adv + pack + logprob + update, sync) and its mean
think length, one core = one device, then predicts all three (so its lock-step split figure checks only
the calibration and the overheads it leaves out).

Prints ``name: value`` lines: each run's mean step time (`time/step`, the first `--skip` steps left
out) and the simulator's prediction beside it, `async_over_sync_step_time` (locked k=1 over today's
lock-step; goal <= 0.75), `inflight_over_sync_step_time` (in-flight k=2 over it), the in-flight run's
staleness metrics, `swap_pause_s` (the in-flight run's mean seconds from pausing generation for a new
version to resuming it), and `sim_error` / `sim_error_inflight` (|predicted - measured| / measured for
locked k=1 and in-flight k=2).

The workload must give the learner work: a random model scores 0 everywhere, every row has zero
advantage and is dropped, and the comparison would time rollouts alone. So by default the script
first warm-starts the quickstart's model here (its supervised steps, a few minutes on 2 cores), whose
rewards vary within a group; `--model` takes an existing warm start instead. It prints the workload's
own figures beside the timings (`lockstep_split_trained_rows`, `lockstep_split_reward_mean`,
`lockstep_split_learner_share`: the learner's part of the split lock-step step) and warns when the
learner trains nothing.

Usage: python benchmarks/async_rl.py [--warm-steps 1200 | --model DIR] [--steps 12] [--skip 2]
                                    [--prompts 8] [--engine hf|vllm [--vllm-frontend llm|async]]
  --warm-steps: the warm start's supervised steps (default: the recipe's);
  --model: an already warm-started model (e.g. runs/quickstart/sft_model);
  --prompts: prompts per step (and per mini-batch) instead of the quickstart's 8.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLLOUT_STAGES = ("gen", "summaries", "reward")
LEARNER_STAGES = ("adv", "pack", "logprob", "update")


def train(out: Path, model: str, steps: int, overrides: list[str], cores: list[int] | None,
          env: dict[str, str]) -> list[dict]:
    cmd = [sys.executable, "-m", "anytime.cli", "train", str(REPO / "recipes" / "quickstart.yaml"),
           f"model.path={model}", "model.tiny=false", "sft.steps=0", f"trainer.steps={steps}",
           f"trainer.output_dir={out}", f"trainer.save_every={steps}", "eval.limit=8", "eval.samples=1",
           "logging.progress=false", "logging.tensorboard=false", *overrides]
    if cores is not None:
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r]


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r.get(key, 0.0) for r in rows)


def start_ray(cores: list[int]) -> str:
    """A local Ray whose processes, the rollout actor included, inherit `cores`; its address. It ends
    with this process (a watchdog ends it should this process be killed)."""
    import ray

    from anytime.core.watchdog import children, watch

    mine = os.sched_getaffinity(0)
    before = children()
    os.sched_setaffinity(0, cores)   # inherited by the processes ray.init starts
    try:
        ray.init(num_cpus=len(cores), include_dashboard=False, log_to_driver=False)
    finally:
        os.sched_setaffinity(0, mine)
    watch(children() - before)
    return ray.get_runtime_context().gcs_address


def simulate_runs(recipe, model: str, measured: list[dict], cores: int) -> dict[str, float]:
    """The simulator calibrated on the lock-step split run: its three predictions."""
    from transformers import AutoTokenizer

    from anytime.analysis.timeline import DecodeModel, Hardware, Split, Workload, simulate
    from anytime.data.prompts import render_prompt

    think = round(mean(measured, "train/think_len"))
    prompt = len(render_prompt(AutoTokenizer.from_pretrained(model), "Start with 3. Step 1: add 4. Step 2: add 5."))
    r = recipe
    workload = Workload(r.rollout.prompts_per_step, r.rollout.n, tuple(r.budget.grid()), r.summary.n,
                        r.summary.max_tokens, prompt, (think,))
    rollout_s = sum(mean(measured, f"time/{k}") for k in ROLLOUT_STAGES)
    learner_s = sum(mean(measured, f"time/{k}") for k in LEARNER_STAGES)
    # one engine decodes the whole batch at once (no slot limit on the CPU): a decode step costs the
    # same whatever the batch, so the rollout time spreads over the decode steps of one trace and its
    # summaries (all cuts' summaries run side by side)
    decode_steps = think + r.summary.max_tokens
    trained = r.rollout.prompts_per_step * r.rollout.n * (prompt + think + len(r.budget.grid()) * r.summary.n
                                                          * r.summary.max_tokens)
    hardware = Hardware(DecodeModel(rollout_s / decode_steps, 1e12), 10**6, trained / learner_s,
                        mean(measured, "time/sync"))
    # today's lock-step as the simulator sees it: every core a device that generates, then learns
    return {"lockstep_both_cores": simulate("lockstep", workload, hardware, Split.colocated_on(cores)).step_s,
            "lockstep_split": simulate("lockstep", workload, hardware, Split(1, 1)).step_s,
            "locked_k1_split": simulate("locked", workload, hardware, Split(1, 1), staleness=1).step_s,
            "inflight_k2_split": simulate("inflight", workload, hardware, Split(1, 1), staleness=2).step_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--warm-steps", type=int, default=None,
                        help="supervised steps of the warm start made here (default: the recipe's)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the means (start-up)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the recipe's)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the rollout engine of all four runs")
    parser.add_argument("--vllm-frontend", choices=("llm", "async"), default="llm",
                        help="with --engine vllm: vLLM's LLM stepped by anytime, or AsyncLLM (rollout.vllm_frontend)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs at least 2 cores: one for the rollout actor, the rest for the learner")
    from anytime.config import load_recipe

    shape = ([f"rollout.prompts_per_step={args.prompts}", f"learner.mini_batch_prompts={args.prompts}"]
             if args.prompts else []) + [f"rollout.engine={args.engine}"]
    if args.engine == "vllm":
        shape.append(f"rollout.vllm_frontend={args.vllm_frontend}")
    elif args.vllm_frontend != "llm":
        parser.error("--vllm-frontend needs --engine vllm")
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", shape)
    work = Path(tempfile.mkdtemp(prefix="async-rl-"))
    model = args.model
    address = None
    try:
        if model is None:   # a warm start: rewards that vary, rows that train
            warm = work / "warm"
            steps = [f"sft.steps={args.warm_steps}"] if args.warm_steps else []
            subprocess.run([sys.executable, "-m", "anytime.cli", "sft", str(REPO / "recipes" / "quickstart.yaml"),
                            f"trainer.output_dir={warm}", f"model.path={warm}/init_model", "logging.progress=false",
                            f"trainer.num_threads={len(cores)}", *steps], check=True, capture_output=True, cwd=REPO)
            model = str(warm / "sft_model")
        both = [*shape, "rollout.placement=inprocess", f"trainer.num_threads={len(cores)}"]
        runs = {"lockstep_both_cores": train(work / "both", model, args.steps, both, None, {})}
        address = start_ray(cores[-1:])
        ray_run = [*shape, "rollout.placement=ray", "rollout.ray_cpus_per_worker=1",
                   f"trainer.num_threads={len(cores) - 1}"]
        env = {"RAY_ADDRESS": address}
        runs["lockstep_split"] = train(work / "split", model, args.steps, ray_run, cores[:-1], env)
        runs["locked_k1_split"] = train(work / "locked", model, args.steps, [*ray_run, "rollout.max_staleness=1"],
                                        cores[:-1], env)
        runs["inflight_k2_split"] = train(work / "inflight", model, args.steps,
                                          [*ray_run, "rollout.max_staleness=2", "rollout.staleness_mode=inflight"],
                                          cores[:-1], env)
        measured = {name: rows[args.skip:] for name, rows in runs.items()}
        predicted = simulate_runs(recipe, model, measured["lockstep_split"], len(cores))
        step = {name: mean(rows, "time/step") for name, rows in measured.items()}
        for name in runs:
            print(f"{name}_step_s: {step[name]:.4f}")
            print(f"sim_{name}_step_s: {predicted[name]:.4f}")
        split = measured["lockstep_split"]
        # the two sides of the split lock-step step: what overlap can hide is the shorter one
        print(f"lockstep_split_rollout_s: {sum(mean(split, f'time/{k}') for k in ROLLOUT_STAGES):.4f}")
        learner_s = sum(mean(split, f"time/{k}") for k in LEARNER_STAGES)
        print(f"lockstep_split_learner_s: {learner_s:.4f}")
        print(f"lockstep_split_sync_s: {mean(split, 'time/sync'):.4f}")
        print(f"lockstep_split_learner_share: {learner_s / mean(split, 'time/step'):.3f}")
        print(f"lockstep_split_trained_rows: {mean(split, 'train/rows'):.1f}")
        print(f"lockstep_split_reward_mean: {mean(split, 'train/anytime_score'):.3f}")
        if mean(split, "train/rows") == 0:
            print("WARNING: the learner trained no row (every group's rewards were equal): the timings compare "
                  "rollouts alone; warm-start longer (--warm-steps) or pass a trained --model", file=sys.stderr)
        locked = measured["locked_k1_split"]
        print(f"locked_k1_learner_wait_s: {mean(locked, 'time/learner_wait'):.4f}")
        print(f"locked_k1_rollout_wait_s: {mean(locked, 'time/rollout_wait'):.4f}")
        print(f"locked_k1_version_lag: {mean(locked, 'rollout/token_version_lag'):.2f}")
        inflight = measured["inflight_k2_split"]
        for key in ("rollout/token_version_lag", "rollout/token_version_lag_max", "rollout/mixed_version_traces",
                    "rollout/weight_swaps", "time/weight_swap"):
            print(f"inflight_k2_{key.split('/')[1]}: {mean(inflight, key):.4f}")
        swaps = sum(r.get("rollout/weight_swaps", 0.0) for r in inflight)
        if swaps:
            print(f"swap_pause_s: {sum(r.get('time/weight_swap', 0.0) for r in inflight) / swaps:.4f}")
        print(f"async_over_sync_step_time: {step['locked_k1_split'] / step['lockstep_both_cores']:.3f}")
        print(f"inflight_over_sync_step_time: {step['inflight_k2_split'] / step['lockstep_both_cores']:.3f}")
        print(f"async_over_split_sync_step_time: {step['locked_k1_split'] / step['lockstep_split']:.3f}")
        print(f"sim_error: {abs(predicted['locked_k1_split'] - step['locked_k1_split']) / step['locked_k1_split']:.3f}")
        inflight_error = abs(predicted['inflight_k2_split'] - step['inflight_k2_split']) / step['inflight_k2_split']
        print(f"sim_error_inflight: {inflight_error:.3f}")
    finally:
        if address is not None:
            import ray

            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
