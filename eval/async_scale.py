"""The step-timeline simulator (anytime.analysis.timeline) at the AnytimeReasoner paper's scale: 8 A100-80GB,
DeepSeek-R1-Distill-Qwen-1.5B, 64 prompts × 8 traces a step, budgets {2000, 4000, 6000, 8000}, 4 summaries
of 128 tokens per cut. For each split of the 8 GPUs and each mode it predicts the steady-state step time
and where it goes, over several shares of traces that reach the 8000-token cap (and, at the central
share, with the learner some factor faster than assumed), and names the configuration to use. Every
throughput and the length distribution are assumptions, stated below with their reasoning; nothing
here ran on a GPU.

    python eval/async_scale.py [--out eval/async] [--steps 24] [--shares 0.1,0.3,0.5] [--learner-factors 2]

Writes `paper_scale.md` and `paper_scale.json` to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import MappingProxyType

import numpy as np

from anytime.analysis.timeline import DecodeModel, Hardware, Prediction, Split, Workload, simulate

REPO = Path(__file__).resolve().parents[1]

GPUS = 8
BUDGETS = (2000, 4000, 6000, 8000)     # recipes/paper: num_budgets 4, the 250:8000:250 grid's 4 even points
CENTRAL_SHARE = 0.3
NEAR_BEST = 0.05                        # within 5% of the fastest, prefer the least stale configuration
SPLITS = (Split.colocated_on(GPUS), Split(4, 4), Split(5, 3), Split(6, 2), Split(7, 1))
MODES = (("lockstep", 0), ("locked", 1), ("locked", 2), ("inflight", 2))
# (name, value, why): assumptions, not measurements.
ASSUMED = (
    ("decode_latency_s", 0.008, "a decode step of a 1.5B model reads its 3.5 GB of bf16 weights (~2.3 ms at "
     "~1.5 TB/s of the A100-80GB's 2.0 TB/s) plus vLLM's per-step scheduling and sampling, a few ms for a model "
     "this small"),
    ("decode_peak_tokens_per_s", 12000.0, "each active sequence adds its KV-cache read: 28 layers × 2 KV heads × "
     "128 × 2 (K, V) × 2 bytes = 28 KB per context token, ~115 MB a step at a 4k-token mean context, ~75 µs at "
     "1.5 TB/s, plus ~8 µs of matmul: ~83 µs a sequence; so 64 active sequences decode ~4.8k tokens/s, 256 ~8.7k"),
    ("max_seqs", 256, "vLLM's default max_num_seqs; the KV cache at gpu_memory_utilization 0.6 (~42 GB, ~1.5M "
     "tokens) holds it at a mean context under ~5.7k tokens (a rollout-only GPU can give it 0.9)"),
    ("learner_tokens_per_s", 5000.0, "per A100, the whole update: old log-probs (2N FLOPs a token) + forward/"
     "backward (6N) + gradient checkpointing's recompute (2N), N = 1.78B: 18 GFLOP a token plus attention at "
     "~4k context (~3 GFLOP), at ~35% of 312 TFLOP/s bf16 under ZeRO-3"),
    ("weight_sync_s", 3.0, "split: gather the ZeRO-3 shards (3.5 GB) and NCCL-broadcast them tensor by tensor to "
     "the engines, which load them (NVLink moves 3.5 GB in ~0.05 s; per-tensor calls and vLLM's load_weights "
     "dominate)"),
    ("weight_sync_s_colocated", 5.0, "colocated: the same load in place plus vLLM's sleep/wake (free and "
     "re-allocate the KV cache, offload the weights) around every update"),
    ("prompt_tokens", 150, "a DeepScaleR problem with the chat template"),
    ("summary_tokens", 128, "every summary runs to its cap (118 sampled + ~10 inserted): an upper bound"),
    ("untruncated_lengths", "log-normal, median 3000, sigma 0.6, below 8000", "the traces that end by themselves "
     "before the cap; the share that reaches the cap is the table's variable"),
)
FIGURES = MappingProxyType({name: value for name, value, _ in ASSUMED})


def length_sample(share_capped: float, size: int = 20000, seed: int = 0) -> tuple[int, ...]:
    """A sample of thinking lengths: `share_capped` of them at the 8000-token cap, the rest log-normal below it."""
    rng = np.random.default_rng(seed)
    natural = rng.lognormal(np.log(3000), 0.6, 4 * size)
    natural = natural[natural < BUDGETS[-1]][:size]
    capped = rng.random(size) < share_capped
    return tuple(int(x) for x in np.where(capped, BUDGETS[-1], np.maximum(natural, 1)))


def hardware(split: Split, learner_factor: float) -> Hardware:
    sync = FIGURES["weight_sync_s_colocated" if split.colocated else "weight_sync_s"]
    return Hardware(DecodeModel(FIGURES["decode_latency_s"], FIGURES["decode_peak_tokens_per_s"]),
                    FIGURES["max_seqs"], FIGURES["learner_tokens_per_s"] * learner_factor, sync)


def predict(share: float, learner_factor: float, steps: int, seed: int) -> list[Prediction]:
    workload = Workload(64, 8, BUDGETS, 4, FIGURES["summary_tokens"], FIGURES["prompt_tokens"], length_sample(share))
    return [simulate(mode, workload, hardware(split, learner_factor), split, k, steps=steps, seed=seed)
            for split in SPLITS for mode, k in MODES if not (split.colocated and mode != "lockstep")]


def case_label(share: float, learner_factor: float) -> str:
    faster = "" if learner_factor == 1 else f", learner {learner_factor:g}× the assumed tokens/s"
    return f"{share:.0%} of traces reach the 8000-token cap{faster}"


def mode_label(p: Prediction) -> str:
    return p.mode if p.mode == "lockstep" else f"{p.mode} k={p.staleness}"


def recommend(predictions: list[Prediction]) -> Prediction:
    """The least stale configuration within NEAR_BEST of the fastest (then the faster)."""
    best = min(p.step_s for p in predictions)
    return min((p for p in predictions if p.step_s <= best * (1 + NEAR_BEST)), key=lambda p: (p.staleness, p.step_s))


def step_table(predictions: list[Prediction]) -> list[str]:
    modes = [mode_label(simulated) for simulated in predictions if simulated.split == SPLITS[1].label()]
    cells = {(p.split, mode_label(p)): p for p in predictions}
    lines = ["| rollout:learner | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for split in SPLITS:
        row = [f"{cells[split.label(), m].step_s:.0f}" if (split.label(), m) in cells else "—" for m in modes]
        lines.append(f"| {split.label()} | " + " | ".join(row) + " |")
    return lines


def breakdown_table(predictions: list[Prediction]) -> list[str]:
    keys = ("step_s", "first_step_s", "generation_s", "summaries_s", "engine_pause_s", "rollout_idle_s", "learner_s",
            "sync_s", "learner_idle_s")
    lines = ["| split | mode | " + " | ".join(k.removesuffix("_s").replace("_", " ") for k in keys) + " |",
             "|---" * (len(keys) + 2) + "|"]
    for p in predictions:
        values = [f"{max(getattr(p, k), 0.0):.0f}" for k in keys]
        lines.append(f"| {p.split} | {mode_label(p)} | " + " | ".join(values) + " |")
    return lines


def report(results: dict[str, list[Prediction]], central: str, steps: int) -> tuple[str, dict]:
    pick = {case: recommend(predictions) for case, predictions in results.items()}
    lines = ["# Asynchronous training at the paper's scale: predicted step times", "",
             "Predicted by `python eval/async_scale.py` (anytime.analysis.timeline, "
             f"{steps} simulated steps, means over the steady window). **Not run on GPUs:** every figure below is "
             "an assumption, not a measurement.", "", "## Assumptions", "",
             "| figure | value | why |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {why} |" for name, value, why in ASSUMED]
    lines += ["", "Workload: 64 prompts × 8 traces a step, budgets " + ", ".join(map(str, BUDGETS)) + " (the paper's "
              "training grid, `recipes/paper`: 4 even points of 250:8000:250), 4 summaries per cut. Modes: "
              "lockstep (on-policy), locked k (batch t from weights t − k, one batch at a time on the engines), "
              "inflight k (a continuous stream, traces start under weights ≥ t − k, engines pause for each sync).",
              ""]
    for case, predictions in results.items():
        lines += [f"## Step time (s), {case}", "", *step_table(predictions),
                  "", f"Fastest within {NEAR_BEST:.0%} and least stale: **{pick[case].split}, "
                  f"{mode_label(pick[case])}** ({pick[case].step_s:.0f} s a step).", ""]
    lines += [f"## Where the time goes, {central} (s per step)", "",
              "Rollout columns are per rollout GPU (generation and summaries split by the share of active sequences); "
              "a colocated GPU does both sides, so both idle columns are its idle time.", "",
              *breakdown_table(results[central]), ""]
    summary = {"assumptions": {name: {"value": value, "why": why} for name, value, why in ASSUMED},
               "workload": {"prompts_per_step": 64, "traces_per_prompt": 8, "budgets": list(BUDGETS),
                            "summaries_per_cut": 4}, "steps": steps,
               "results": {case: [p.as_dict() for p in predictions] for case, predictions in results.items()},
               "recommended": {case: {"split": p.split, "mode": p.mode, "staleness": p.staleness, "step_s": p.step_s}
                               for case, p in pick.items()}}
    return "\n".join(lines), summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "eval" / "async")
    parser.add_argument("--steps", type=int, default=24, help="batches simulated per configuration")
    parser.add_argument("--shares", default="0.1,0.3,0.5", help="shares of traces that reach the largest budget")
    parser.add_argument("--learner-factors", default="2",
                        help="learner tokens/s multiples to try at the central share (comma-separated; '' for none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    central = CENTRAL_SHARE if CENTRAL_SHARE in shares else shares[len(shares) // 2]
    cases = [(share, 1.0) for share in shares] + [(central, float(f)) for f in args.learner_factors.split(",") if f]
    results = {case_label(*case): predict(*case, args.steps, args.seed) for case in cases}
    markdown, summary = report(results, case_label(central, 1.0), args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paper_scale.md").write_text(markdown)
    (args.out / "paper_scale.json").write_text(json.dumps(summary, indent=1) + "\n")
    for case, p in summary["recommended"].items():
        print(f"recommended ({case}): {p['split']} {p['mode']} k={p['staleness']}, {p['step_s']:.1f} s a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
