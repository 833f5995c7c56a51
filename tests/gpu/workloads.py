"""The GPU tier's workloads: short `anytime train` runs on CUDA, each defined once here for its test in
`tests/gpu/` and for `benchmarks/gpu_smoke.py`, which times them.

Each run is the CLI in a process of its own (`python -m anytime.cli train`), as a user runs it: a run
that fails or hangs cannot take the GPU memory of the next one with it, and what it starts (vLLM's
engine core, Ray, torchrun's learners) ends with it. Runs write only into the folder they are given.

The quickstart runs train the suite's tiny model (`cached_tiny_model("tiny")`, the `tiny_model_dir`
fixture: head dim 64, which every vLLM GPU attention backend serves) in bf16 at lr 1e-2, where an engine
that missed a weight sync samples visibly off the learner (`train/logprob_mismatch`); the paper runs
build their tiny model from the recipe (`model.tiny`)."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import QUICKSTART, REPO, cached_tiny_model

PAPER = str(REPO / "recipes" / "paper" / "ar_linear.yaml")
MATH = Path(os.environ.get("ANYTIME_MATH_DATA", REPO / "tests" / "fixtures" / "math"))
# The skip reason of each optional library a workload may need.
NEEDS = {"vllm": "needs vLLM", "deepspeed": "needs DeepSpeed", "ray": "needs Ray"}
RUN_TIMEOUT_S = 420
# At lr 1e-2 an engine that kept older weights samples ~0.16 nats a token off the learner on the tiny
# model (tests/trainer/test_vllm_learners.py); bf16 numerics alone should stay well below this
# (not yet measured on a GPU).
STALE_MISMATCH = 0.08


def quickstart_on_gpu(out: Path, steps: int) -> list[str]:
    """A few-step quickstart on the tiny model in bf16: small batches and budgets, a short eval."""
    return [f"trainer.output_dir={out}", f"model.path={cached_tiny_model('tiny', corpus_size=400, seed=0)}",
            "model.tiny=false", "model.dtype=bfloat16", "sft.steps=0", f"trainer.steps={steps}",
            f"trainer.save_every={steps}", "rollout.prompts_per_step=4", "rollout.n=4", "summary.n=2",
            "budget.budgets=[16,32]", "budget.max_thinking=32", "learner.mini_batch_prompts=4", "learner.lr=1e-2",
            "algorithm.entropy_coef=0.01", "eval.limit=4", "eval.samples=2", "logging.progress=false",
            "logging.tensorboard=false"]


def paper_on_gpu(out: Path, steps: int) -> list[str]:
    """recipes/paper/ar_linear.yaml (bf16, vLLM with sleep mode, BRPO, the linear prior, its clip and
    learning rate, summaries, prompt length and grid of four budgets) on a tiny model built from its
    config and the shipped MATH stand-ins, its sizes scaled down to seconds: budgets 64..256 for
    2000..8000, 16 prompts a step for 64 (still two optimizer steps a batch), summaries of 24 tokens
    for 118, a 2-problem eval; the torch learner on one GPU for DeepSpeed on eight."""
    return [f"trainer.output_dir={out}", f"model.path={out.parent / 'model'}", "model.tiny=true",
            f"data.train={MATH / 'train_math.json'}", "data.limit=32", "budget.max_thinking=256",
            "eval.budgets=[64,128,192,256]", "summary.max_tokens=24",
            "algorithm.loss_norm_length=null",   # the paper's 10176 derives from its 8k budget; null derives ours
            "rollout.prompts_per_step=16", "learner.mini_batch_prompts=8", "learner.backend=torch",
            "learner.num_processes=1",
            "algorithm.entropy_coef=0.001",   # a random model scores 0 everywhere: the bonus keeps rows to train
            f"eval.data_dir={MATH}", "eval.limit=2", "eval.samples=2", f"trainer.steps={steps}",
            f"trainer.save_every={steps}", "logging.progress=false", "logging.tensorboard=false"]


@dataclass(frozen=True)
class Workload:
    """One run: its recipe, its own overrides on top of the recipe's GPU base, what it needs."""

    name: str
    what: str
    recipe: str
    overrides: tuple[str, ...]
    needs: tuple[str, ...] = ()
    gpus: int = 1
    steps: int = 3

    def command(self, out: Path, steps: int | None = None) -> list[str]:
        steps = self.steps if steps is None else steps
        base = paper_on_gpu(out, steps) if self.recipe == PAPER else quickstart_on_gpu(out, steps)
        return [sys.executable, "-m", "anytime.cli", "train", self.recipe, *base, *self.overrides]


DEEPSPEED_BF16 = ("learner.backend=deepspeed", "learner.zero_stage=3", "learner.bf16=true")   # the paper's learner
WORKLOADS = {w.name: w for w in (
    Workload("quickstart_vllm_sleep", "quickstart, vLLM in process, asleep during each update", QUICKSTART,
             ("sft.steps=20", "rollout.engine=vllm", "rollout.enable_sleep=true"), needs=("vllm",)),
    Workload("asyncllm_ipc", "lock-step on AsyncLLM: its engine core takes each step's weights by CUDA IPC",
             QUICKSTART, ("rollout.engine=vllm", "rollout.vllm_frontend=async"), needs=("vllm",)),
    Workload("inflight_asyncllm_ipc", "in flight (k=1) on AsyncLLM in a worker process of its own, on GPU 1",
             QUICKSTART, ("rollout.engine=vllm", "rollout.vllm_frontend=async", "rollout.max_staleness=1",
                          "rollout.staleness_mode=inflight", "rollout.placement=processes",
                          "algorithm.offpolicy_correction=tis"), needs=("vllm",), gpus=2),
    Workload("deepspeed_zero3_bf16", "DeepSpeed ZeRO-3 in bf16, transformers engine", QUICKSTART,
             (*DEEPSPEED_BF16, "rollout.engine=hf"), needs=("deepspeed",)),
    Workload("deepspeed_two_ranks", "DeepSpeed ZeRO-3 in bf16 on two learner processes (NCCL), colocated engines",
             QUICKSTART, (*DEEPSPEED_BF16, "learner.num_processes=2", "rollout.engine=hf"), needs=("deepspeed",),
             gpus=2),
    Workload("deepspeed_ray_nccl", "DeepSpeed ZeRO-3 in bf16, a vLLM Ray actor on GPU 1 taking weights by NCCL",
             QUICKSTART, (*DEEPSPEED_BF16, "rollout.engine=vllm", "rollout.placement=ray", "rollout.workers=1",
                          "rollout.weight_sync=nccl"), needs=("deepspeed", "ray", "vllm"), gpus=2),
    Workload("paper_hf", "recipes/paper/ar_linear.yaml scaled down, transformers engine", PAPER,
             ("rollout.engine=hf",), steps=2),
    Workload("paper_vllm", "recipes/paper/ar_linear.yaml scaled down, vLLM asleep during each update", PAPER,
             ("rollout.engine=vllm",), needs=("vllm",), steps=2),
)}


class RunFailed(AssertionError):
    """A run that exited non-zero or timed out, with the end of its output."""


def train(workload: Workload, folder: Path, steps: int | None = None, timeout_s: float = RUN_TIMEOUT_S
          ) -> dict[int, dict]:
    """Run `workload` in `folder` (its run folder is `folder / "run"`); every training step's metrics
    by step, the timings included."""
    out = folder / "run"
    # a session of its own: a run that hangs is ended whole (torchrun, its learners, their engines)
    proc = subprocess.Popen(workload.command(out, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as exc:   # a timeout, or the test run interrupted: nothing of the run may outlive it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)   # the watchdogs, in sessions of their own, clean up after it
        stdout = stderr = ""
        with contextlib.suppress(subprocess.TimeoutExpired):   # a survivor may still hold the pipes
            stdout, stderr = proc.communicate(timeout=30)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RunFailed(f"{workload.name} ran past {timeout_s:.0f} s:\n{_tail(stdout)}\n{_tail(stderr)}") from None
        raise
    if proc.returncode != 0:
        raise RunFailed(f"{workload.name} exited {proc.returncode}:\n{_tail(stdout)}\n{_tail(stderr)}")
    return step_metrics(out)


def _tail(text: str | None, chars: int = 4000) -> str:
    return (text or "")[-chars:]


def step_metrics(out: Path) -> dict[int, dict]:
    """The rows of `metrics.jsonl` that are training steps, by step, every key kept (`read_metrics`
    drops the `time/` and `perf/` ones)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/rows" in r}


def assert_trained(metrics: dict[int, dict], steps: int) -> None:
    """Every step ran, every figure it logged is finite, and every update took a real optimizer step."""
    assert sorted(metrics) == list(range(1, steps + 1)), sorted(metrics)
    for step, m in metrics.items():
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite {bad}"
        assert m["train/rows"] > 0 and m["update/skipped_updates"] == 0, (step, m)
        assert m["update/grad_norm"] > 0 and m["time/sync"] > 0, (step, m)


def missing(workload: Workload) -> str | None:
    """Why `workload` cannot run on this machine (no CUDA, too few GPUs, a library that does not
    import), or None when it can; for the benchmark (the tests skip through the tier and importorskip)."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.device_count() < workload.gpus:
        return f"needs {workload.gpus} GPUs"
    for module in workload.needs:
        try:
            importlib.import_module(module)
        except Exception:   # not installed, or installed without what it needs here
            return NEEDS[module]
    return None


def require(workload: Workload) -> None:
    """Skip the calling test, with the library's reason, when one the workload needs does not import."""
    import pytest

    for module in workload.needs:
        pytest.importorskip(module, reason=NEEDS[module], exc_type=ImportError)
