"""The GPU tier's workloads: short `anytime train` runs on CUDA, each defined once here, with what it
must show (its checks), for its test in `tests/gpu/` and for `benchmarks/gpu_smoke.py`, which runs and
times them; and the tier's probes, its checks that are no training run (`anytime serve`), which the
smoke runs as their pytest test.

Each run is the CLI in a process of its own (`python -m anytime.cli train`), as a user runs it: a run
that fails or hangs cannot take the GPU memory of the next one with it, and what it starts (vLLM's
engine core, Ray, torchrun's learners) ends with it. A run that outlives its limit (`limit_s`) is ended
whole and fails naming its workload: a hang is a failure, not a stuck machine. Runs write only into the
folder they are given.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import QUICKSTART, REPO, cached_tiny_model

PAPER = str(REPO / "recipes" / "paper" / "ar_linear.yaml")
MATH = Path(os.environ.get("ANYTIME_MATH_DATA", REPO / "tests" / "fixtures" / "math"))
# The skip reason of each optional library a workload may need.
NEEDS = {"vllm": "needs vLLM", "deepspeed": "needs DeepSpeed", "ray": "needs Ray", "peft": "needs peft"}
# A run's default limit. None of these has run on a GPU yet: the limits are guesses at 2-3x a tiny run
# (process start-up, torch.compile and CUDA graphs of each vLLM engine, a few steps, two short evals).
RUN_TIMEOUT_S = 420
# How long an overrun run's process may take to go once its process group is killed.
KILL_WAIT_S = 10
# At lr 1e-2 an engine that kept older weights samples ~0.16 nats a token off the learner on the tiny
# model (tests/trainer/test_vllm_learners.py); bf16 numerics alone should stay well below this
# (not yet measured on a GPU).
STALE_MISMATCH = 0.08
# What a run logs when its engine takes the LoRA adapter merged into full weights (anytime.rollout.workers.worker).
MERGED_ADAPTER_LOG = "the LoRA adapter is merged into the base"


def quickstart_on_gpu(out: Path, steps: int, model: str | Path | None) -> list[str]:
    """A few-step quickstart on the tiny model `model` in bf16: small batches and budgets, a short eval."""
    return [f"trainer.output_dir={out}", f"model.path={model}", "model.tiny=false", "model.dtype=bfloat16",
            "sft.steps=0", f"trainer.steps={steps}", f"trainer.save_every={steps}", "rollout.prompts_per_step=4",
            "rollout.n=4", "summary.n=2", "budget.budgets=[16,32]", "budget.max_thinking=32",
            "learner.mini_batch_prompts=4", "learner.lr=1e-2", "algorithm.entropy_coef=0.01", "eval.limit=4",
            "eval.samples=2", "logging.progress=false", "logging.tensorboard=false"]


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
class FinishedRun:
    """A run that exited 0: its training steps' metrics by step, its run folder and its output."""

    metrics: dict[int, dict]
    out: Path
    steps: int
    log: str


Check = Callable[[FinishedRun], None]


def assert_trained(metrics: dict[int, dict], steps: int) -> None:
    """Every step ran, every figure it logged is finite, and every update took a real optimizer step."""
    assert sorted(metrics) == list(range(1, steps + 1)), sorted(metrics)
    for step, m in metrics.items():
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite {bad}"
        assert m["train/rows"] > 0 and m["update/skipped_updates"] == 0, (step, m)
        assert m["update/grad_norm"] > 0 and m["time/sync"] > 0, (step, m)


def synced(run: FinishedRun) -> None:
    """Each step after the first sampled with the weights the learner synced after the step before
    (step 1 sampled the start weights)."""
    for step in range(2, run.steps + 1):
        assert run.metrics[step]["train/logprob_mismatch"] < STALE_MISMATCH, (step, run.metrics[step])


def checkpointed(run: FinishedRun) -> None:
    assert (run.out / "checkpoints" / f"step_{run.steps}").is_dir()


def model_saved(run: FinishedRun) -> None:
    assert (run.out / "checkpoints" / f"step_{run.steps}" / "model" / "model.safetensors").is_file()


def warm_started(run: FinishedRun) -> None:
    assert (run.out / "sft_model" / "sft_done.txt").is_file()


def evaluated(run: FinishedRun) -> None:
    """The held-out evals before and after training gave a score."""
    final = json.loads((run.out / "final_eval.json").read_text())
    assert all(math.isfinite(final[when]["eval/anytime"]) for when in ("before", "after")), final


def paper_shaped(run: FinishedRun) -> None:
    """The run kept the paper's precision and memory settings, and scored the grid of four budgets (scaled)."""
    recipe = (run.out / "recipe.yaml").read_text()
    assert "dtype: bfloat16" in recipe and "gradient_checkpointing: true" in recipe
    for m in run.metrics.values():
        assert all(0.0 <= m[f"train/acc@{b}"] <= 1.0 for b in (64, 128, 192, 256)), m


def swapped_in_flight(run: FinishedRun) -> None:
    """Version 1 is offered after step 1's update and step 3's batch cannot start without it (k = 1)."""
    assert sum(m["rollout/weight_swaps"] for m in run.metrics.values()) >= 1
    assert any(m.get("time/weight_swap", 0.0) > 0 for m in run.metrics.values())
    for step, m in run.metrics.items():
        assert 0 <= m["rollout/token_version_lag"] <= m["rollout/token_version_lag_max"] <= 1, step


def adapter_served(run: FinishedRun) -> None:
    """vLLM took each step's LoRA adapter as an adapter (a `LoRARequest`), not merged into full
    weights, and the checkpoint holds the adapter only."""
    assert MERGED_ADAPTER_LOG not in run.log, "the engine took merged full weights instead of the adapter"
    assert list((run.out / "checkpoints" / f"step_{run.steps}").rglob("adapter_config.json")), "no adapter saved"


@dataclass(frozen=True)
class Workload:
    """One run: its recipe, its own overrides on top of the recipe's GPU base, what it needs, how long
    it may take, what it must show beyond having trained, and the gpu-tier test that runs it."""

    name: str
    what: str
    recipe: str
    overrides: tuple[str, ...]
    test: str
    needs: tuple[str, ...] = ()
    gpus: int = 1
    steps: int = 3
    limit_s: int = RUN_TIMEOUT_S
    checks: tuple[Check, ...] = ()

    def arguments(self, out: Path, steps: int, model: str | Path | None) -> list[str]:
        """The recipe overrides of a run in `out` (`model`: the tiny model of the quickstart runs; the
        paper runs build theirs)."""
        base = paper_on_gpu(out, steps) if self.recipe == PAPER else quickstart_on_gpu(out, steps, model)
        return [*base, *self.overrides]

    def command(self, out: Path, steps: int | None = None) -> list[str]:
        steps = self.steps if steps is None else steps
        model = None if self.recipe == PAPER else cached_tiny_model("tiny", corpus_size=400, seed=0)
        return [sys.executable, "-m", "anytime.cli", "train", self.recipe, *self.arguments(out, steps, model)]

    def check(self, run: FinishedRun) -> None:
        assert_trained(run.metrics, run.steps)
        for check in self.checks:
            check(run)


@dataclass(frozen=True)
class Probe:
    """A gpu-tier test that is no training run: the smoke runs `test` under pytest, within `limit_s`."""

    name: str
    what: str
    test: str
    needs: tuple[str, ...] = ()
    gpus: int = 1
    limit_s: int = RUN_TIMEOUT_S


def _test(file: str, name: str) -> str:
    return f"tests/gpu/{file}::{name}"


DEEPSPEED_BF16 = ("learner.backend=deepspeed", "learner.zero_stage=3", "learner.bf16=true")   # the paper's learner
# The paper's 7B mesh (recipes/paper/ar_uniform_7b.yaml) on 2 GPUs: 2 stages of one replica, ZB-H1.
PIPELINE_ZBH1 = ("learner.pipeline.stages=2", "learner.num_processes=2", "learner.pipeline.schedule=zb-h1",
                 "learner.pipeline.microbatches=4", "rollout.engine=hf")
WORKLOADS = {w.name: w for w in (
    Workload("pipeline_zbh1_nccl", "a 2-stage ZB-H1 pipeline learner (torch, float32: its pipeline keeps no "
             "float32 masters) over NCCL on 2 GPUs; its gathered weights reach the engine",
             QUICKSTART, (*PIPELINE_ZBH1, "model.dtype=float32"), _test("test_gpu_pipeline.py",
             "test_a_two_stage_zero_bubble_pipeline_trains_over_nccl"), gpus=2, limit_s=240,
             checks=(synced, checkpointed)),
    Workload("pipeline_deepspeed_zero2_bf16", "the paper's 7B learner mesh scaled to 2 GPUs: 2 ZB-H1 stages, "
             "each a DeepSpeed ZeRO-2 engine in bf16, over NCCL",
             QUICKSTART, (*PIPELINE_ZBH1, "learner.backend=deepspeed", "learner.zero_stage=2", "learner.bf16=true"),
             _test("test_gpu_pipeline.py", "test_the_papers_deepspeed_pipeline_trains_in_bf16_over_nccl"),
             needs=("deepspeed",), gpus=2, limit_s=360, checks=(synced, checkpointed)),
    Workload("colocated_vllm_sleep_two_ranks", "a vLLM engine (llm frontend) beside each of 2 learner ranks, "
             "asleep during every update, woken for the weight sync",
             QUICKSTART, ("learner.num_processes=2", "rollout.placement=colocated", "rollout.engine=vllm",
                          "rollout.vllm_frontend=llm", "rollout.enable_sleep=true"),
             _test("test_gpu_colocated.py", "test_colocated_vllm_engines_sleep_through_each_update_on_two_ranks"),
             needs=("vllm",), gpus=2, limit_s=300, checks=(synced,)),
    Workload("lora_vllm_adapter", "LoRA (rank 8) with vLLM serving the adapter itself as a LoRARequest per "
             "weight version (learner.lora.vllm_serving: auto picks it on CUDA)",
             QUICKSTART, ("learner.lora.rank=8", "rollout.engine=vllm"),
             _test("test_gpu_lora.py", "test_vllm_samples_from_each_steps_lora_adapter"),
             needs=("vllm", "peft"), limit_s=240, checks=(synced, adapter_served)),
    Workload("quickstart_vllm_sleep", "quickstart, vLLM in process, asleep during each update", QUICKSTART,
             ("sft.steps=20", "rollout.engine=vllm", "rollout.enable_sleep=true"),
             _test("test_gpu_quickstart.py", "test_quickstart_trains_on_vllm_that_sleeps_through_each_update"),
             needs=("vllm",), limit_s=300, checks=(warm_started, synced, evaluated)),
    Workload("asyncllm_ipc", "lock-step on AsyncLLM: its engine core takes each step's weights by CUDA IPC",
             QUICKSTART, ("rollout.engine=vllm", "rollout.vllm_frontend=async"),
             _test("test_gpu_async.py", "test_the_asyncllm_engine_core_takes_each_steps_weights_by_cuda_ipc"),
             needs=("vllm",), limit_s=240, checks=(synced,)),
    Workload("inflight_asyncllm_ipc", "in flight (k=1) on AsyncLLM in a worker process of its own, on GPU 1",
             QUICKSTART, ("rollout.engine=vllm", "rollout.vllm_frontend=async", "rollout.max_staleness=1",
                          "rollout.staleness_mode=inflight", "rollout.placement=processes",
                          "algorithm.offpolicy_correction=tis"),
             _test("test_gpu_async.py", "test_inflight_swaps_reach_the_asyncllm_engine_core_by_cuda_ipc"),
             needs=("vllm",), gpus=2, limit_s=300, checks=(swapped_in_flight,)),
    Workload("deepspeed_zero3_bf16", "DeepSpeed ZeRO-3 in bf16, transformers engine", QUICKSTART,
             (*DEEPSPEED_BF16, "rollout.engine=hf"),
             _test("test_gpu_deepspeed.py", "test_deepspeed_zero3_trains_in_bf16_on_one_gpu"),
             needs=("deepspeed",), limit_s=360, checks=(checkpointed,)),   # FusedAdam's JIT build included
    Workload("deepspeed_two_ranks", "DeepSpeed ZeRO-3 in bf16 on two learner processes (NCCL), colocated engines",
             QUICKSTART, (*DEEPSPEED_BF16, "learner.num_processes=2", "rollout.engine=hf"),
             _test("test_gpu_deepspeed.py", "test_deepspeed_zero3_trains_in_bf16_on_two_ranks_over_nccl"),
             needs=("deepspeed",), gpus=2, limit_s=360, checks=(synced,)),
    Workload("deepspeed_ray_nccl", "DeepSpeed ZeRO-3 in bf16, a vLLM Ray actor on GPU 1 taking weights by NCCL",
             QUICKSTART, (*DEEPSPEED_BF16, "rollout.engine=vllm", "rollout.placement=ray", "rollout.workers=1",
                          "rollout.weight_sync=nccl"),
             _test("test_gpu_deepspeed.py", "test_a_vllm_ray_actor_takes_deepspeed_weights_by_nccl"),
             needs=("deepspeed", "ray", "vllm"), gpus=2, checks=(synced,)),
    Workload("paper_vllm", "recipes/paper/ar_linear.yaml scaled down, vLLM asleep during each update", PAPER,
             ("rollout.engine=vllm",), _test("test_gpu_paper_recipe.py",
                                              "test_two_steps_of_the_paper_recipe_on_a_tiny_model[vllm]"),
             needs=("vllm",), steps=2, limit_s=300, checks=(paper_shaped, evaluated, model_saved)),
    Workload("paper_hf", "recipes/paper/ar_linear.yaml scaled down, transformers engine", PAPER,
             ("rollout.engine=hf",), _test("test_gpu_paper_recipe.py",
                                            "test_two_steps_of_the_paper_recipe_on_a_tiny_model[hf]"),
             steps=2, limit_s=300, checks=(paper_shaped, evaluated, model_saved)),
)}
PROBES = {p.name: p for p in (
    Probe("serve_at_budget", "`anytime serve` of an exported tiny model: /health, then completions and chat "
          "requests with thinking_token_budget: the thinking is cut at the budget, the answer follows",
          _test("test_gpu_serve.py", "test_a_served_request_thinks_for_its_budget_then_answers"),
          needs=("vllm",), limit_s=180),   # eager: no CUDA graphs to capture for a dozen requests
)}


class RunFailed(AssertionError):
    """A run that exited non-zero or timed out, with the end of its output."""


def train(workload: Workload, folder: Path, steps: int | None = None, timeout_s: float | None = None
          ) -> FinishedRun:
    """Run `workload` in `folder` (its run folder is `folder / "run"`, its output `folder / "train.log"`)
    within `timeout_s` (default: the workload's limit); every training step's metrics by step, the
    timings included."""
    steps = workload.steps if steps is None else steps
    timeout_s = workload.limit_s if timeout_s is None else timeout_s
    out, log = folder / "run", folder / "train.log"
    # output to a file, not a pipe: a survivor in a session of its own (a watchdog, an engine core) could
    # hold a pipe open, and the wait for its end would outlast the run's limit
    with open(log, "w") as log_file:
        # a session of its own: a run that hangs is ended whole (torchrun, its learners, their engines)
        proc = subprocess.Popen(workload.command(out, steps), stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except BaseException as exc:   # a timeout, or the test run interrupted: nothing of the run may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)   # the watchdogs, in sessions of their own, clean up after it
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_WAIT_S)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise RunFailed(f"{workload.name} ran past {timeout_s:.0f} s:\n{_tail(log.read_text())}") from None
            raise
    output = log.read_text()
    if proc.returncode != 0:
        raise RunFailed(f"{workload.name} exited {proc.returncode}:\n{_tail(output)}")
    return FinishedRun(step_metrics(out), out, steps, output)


def run_checked(workload: Workload, folder: Path) -> FinishedRun:
    """A gpu-tier test's whole body: skip where a library it needs is missing, run it, check it."""
    require(workload)
    run = train(workload, folder)
    workload.check(run)
    return run


def _tail(text: str, chars: int = 8000) -> str:
    return text[-chars:]


def step_metrics(out: Path) -> dict[int, dict]:
    """The rows of `metrics.jsonl` that are training steps, by step, every key kept (`read_metrics`
    drops the `time/` and `perf/` ones)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/rows" in r}


def missing(item: Workload | Probe) -> str | None:
    """Why `item` cannot run on this machine (no CUDA, too few GPUs, a library that does not
    import), or None when it can; for the benchmark (the tests skip through the tier and importorskip)."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.device_count() < item.gpus:
        return f"needs {item.gpus} GPUs"
    for module in item.needs:
        try:
            importlib.import_module(module)
        except Exception:   # not installed, or installed without what it needs here
            return NEEDS[module]
    return None


def require(item: Workload | Probe) -> None:
    """Skip the calling test, with the library's reason, when one the item needs does not import."""
    import pytest

    for module in item.needs:
        pytest.importorskip(module, reason=NEEDS[module], exc_type=ImportError)
