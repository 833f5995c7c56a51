"""Cross-field checks of the recipe's rollout, LoRA and data sections, each naming the key to change
(`anytime.config.validate` runs them; they live here to keep the schema module readable). They read
the recipe by attribute, so this module imports nothing from `anytime.config`."""

from __future__ import annotations

from typing import Any

from anytime.errors import RecipeError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def resolve_placement(r: Any, world: int | None = None) -> str:
    """Where a run's rollouts go: `rollout.placement`, with `auto` resolved from the learner world
    (default: the learner processes the recipe starts, pipeline stages included). The one rule, used by
    the recipe checks, the run and `anytime doctor`."""
    placement = r.rollout.placement
    if placement != "auto":
        return placement
    if r.rollout.staleness_mode == "inflight":   # in flight needs a worker of its own
        return "processes"
    return "inprocess" if (r.learner.processes if world is None else world) == 1 else "colocated"


def check_rollout(r: Any) -> None:
    """`rollout`: where workers run, staleness and in-flight updates (r: an `anytime.config.Recipe`)."""
    placement = resolve_placement(r)
    apart = placement in ("ray", "processes")   # workers in processes of their own
    require(r.rollout.workers == 1 or apart, f"`rollout.workers` ({r.rollout.workers}) > 1 needs `rollout.placement: "
            "ray` or `processes`; colocated runs one worker per learner process (raise learner.num_processes)")
    k, shared = r.rollout.max_staleness, placement == "colocated"
    require(k >= 0, f"`rollout.max_staleness` must be >= 0 (0 = lock-step), got {k}")
    require(r.rollout.worker_restarts == 0 or (r.rollout.placement == "ray" and r.rollout.worker_restarts > 0),
            f"`rollout.worker_restarts` ({r.rollout.worker_restarts}) restarts Ray actors: needs placement ray, >= 0")
    require(r.rollout.worker_restarts == 0 or r.rollout.seed_requests,
            f"`rollout.worker_restarts` ({r.rollout.worker_restarts}) regenerates a dead actor's rows with the same "
            "samples, which needs seeded requests: set rollout.seed_requests=true or rollout.worker_restarts=0")
    require(k == 0 or not (shared or r.rollout.enable_sleep),
            "`rollout.max_staleness` > 0 needs rollouts apart from the learner: colocated rollouts and "
            "`rollout.enable_sleep` share its device and stay lock-step; use `rollout.placement: ray` or processes "
            "(or inprocess, which keeps the same samples without the overlap)")
    for ok, need in ((k >= 1, "`rollout.max_staleness` >= 1 (the versions a batch may span)"),
                     (apart, "workers in their own processes: `rollout.placement: ray` or `processes`"),
                     (r.rollout.weight_sync != "nccl", "`rollout.weight_sync: object_store` (NCCL is a collective the "
                                                       "generating workers cannot join)"),
                     (r.rollout.worker_restarts == 0, "`rollout.worker_restarts: 0` (a restart regenerates with the "
                                                      "weights a rollout started from, which inflight does not keep)")):
        require(ok or r.rollout.staleness_mode == "locked", f"`rollout.staleness_mode: inflight` needs {need}")
    require(r.rollout.vllm_frontend == "llm" or r.rollout.engine == "vllm",
            f"`rollout.vllm_frontend: {r.rollout.vllm_frontend}` chooses how the vllm engine is driven; this recipe's "
            f"engine is {r.rollout.engine}: set rollout.engine=vllm or drop rollout.vllm_frontend")
    require(r.rollout.logprobs == "raw" or r.learner.pipeline.stages == 1,
            "`rollout.logprobs: processed` is not supported by the pipelined learner (`learner.pipeline.stages` > 1): "
            "set rollout.logprobs=raw or learner.pipeline.stages=1")
    require(not apart or r.rollout.workers <= r.rollout.prompts_per_step,
            f"`rollout.workers` ({r.rollout.workers}) exceeds `rollout.prompts_per_step` "
            f"({r.rollout.prompts_per_step}): every worker needs a prompt")


def check_lora(r: Any) -> None:
    """`learner.lora` and `learner.trainable_layers`: the adapter's settings and the learners that
    train one or a model's top layers."""
    lo = r.learner.lora
    require(r.learner.trainable_layers >= 0,
            f"`learner.trainable_layers` must be >= 0 (0 = every layer trains), got {r.learner.trainable_layers}")
    require(r.learner.trainable_layers == 0 or r.learner.pipeline.stages == 1,
            "`learner.trainable_layers` is not supported by the pipelined learner (`learner.pipeline.stages` > 1): "
            "set learner.trainable_layers=0 or learner.pipeline.stages=1")
    require(lo.rank >= 0, f"`learner.lora.rank` must be >= 0 (0 = full fine-tuning), got {lo.rank}")
    if lo.rank == 0:
        return
    require(lo.alpha > 0, f"`learner.lora.alpha` must be > 0, got {lo.alpha}")
    require(0 <= lo.dropout < 1, f"`learner.lora.dropout` must be in [0, 1), got {lo.dropout}")
    require(len(lo.target_modules) > 0, "`learner.lora.target_modules` must name at least one linear layer, "
            "e.g. [q_proj, v_proj]")
    require(r.learner.pipeline.stages == 1,
            "`learner.lora.rank` > 0 is not supported by the pipelined learner (`learner.pipeline.stages` > 1): "
            "set learner.lora.rank=0 or learner.pipeline.stages=1")
    require(r.learner.backend != "deepspeed" or r.learner.zero_stage < 3,
            "`learner.lora.rank` > 0 with DeepSpeed supports ZeRO stages 0-2 (the adapter is small; ZeRO-3 would "
            "partition the frozen base too): set learner.zero_stage=2")


def check_precision(r: Any) -> None:
    """Low-precision weights (`model.dtype` bfloat16 / float16) must be stepped through a float32 copy:
    an lr-1e-6 AdamW step is mostly below bf16's rounding of a weight. The torch learner and DeepSpeed's
    ZeRO 1-3 and bf16 modes keep one; the torch pipeline and DeepSpeed's plain ZeRO-0 would not."""
    if r.model.dtype not in ("bfloat16", "float16"):
        return
    require(not (r.learner.backend == "torch" and r.learner.pipeline.stages > 1),
            f"the torch pipeline learner would step `model.dtype: {r.model.dtype}` weights with no float32 copy, "
            "losing small updates: use learner.backend=deepspeed (its ZeRO keeps one) or model.dtype=float32")
    require(not (r.learner.backend == "deepspeed" and r.learner.zero_stage == 0 and not r.learner.bf16),
            f"DeepSpeed ZeRO-0 without `learner.bf16` would step `model.dtype: {r.model.dtype}` weights with no "
            "float32 copy, losing small updates: set learner.bf16=true, learner.zero_stage >= 1, or model.dtype=float32")


def check_old_logprobs(r: Any) -> None:
    """`learner.old_logprobs: update` only where the recomputed ones would equal the update's own: one
    pass over one mini-batch, rolled out by these very weights, with nothing that reads them apart."""
    if r.learner.old_logprobs != "update":
        return
    lc, why = r.learner, []
    if lc.ppo_epochs != 1:
        why.append(f"learner.ppo_epochs is {lc.ppo_epochs} (set 1)")
    if lc.mini_batch_prompts < r.rollout.prompts_per_step:
        why.append(f"learner.mini_batch_prompts ({lc.mini_batch_prompts}) is below rollout.prompts_per_step "
                   f"({r.rollout.prompts_per_step}): set it to at least that, for one mini-batch a step")
    if r.rollout.max_staleness:
        why.append(f"rollout.max_staleness is {r.rollout.max_staleness} (set 0: stale rollouts need the correction)")
    if r.algorithm.offpolicy_correction != "none":
        why.append(f"algorithm.offpolicy_correction is {r.algorithm.offpolicy_correction} (set none)")
    if lc.pipeline.stages > 1:
        why.append("learner.pipeline.stages > 1 (the pipelined learner recomputes them)")
    require(not why, "`learner.old_logprobs: update` reuses the update's own log-probs, exact only for fully on-policy "
            "steps; set learner.old_logprobs=recompute, or: " + "; ".join(why))


def check_data(r: Any) -> None:
    """`data`: a procedural task (`data.train: reasoning_gym:<task>`) exists, its knobs build it, and
    the eval benchmarks naming tasks name real ones; checked at load so a typo fails before any model
    loads. Imports reasoning-gym only for a recipe that names a task."""
    from anytime.tasks.procedural import TaskError, check_task, make_dataset, task_name

    d, name = r.data, task_name(r.data.train)
    require(d.task_size > 0, f"`data.task_size` must be a positive integer, got {d.task_size}")
    require(name is not None or not d.task_config, "`data.task_config` sets the knobs of a procedural task; it needs "
            f"`data.train: reasoning_gym:<task>` (data.train is {d.train!r})")
    try:
        if name is not None:
            make_dataset(name, d.task_config, seed=0, size=1)
        for benchmark in r.eval.benchmarks:
            if task_name(benchmark) is not None and benchmark != d.train:
                check_task(task_name(benchmark), "eval.benchmarks")
    except TaskError as exc:
        raise RecipeError(str(exc)) from None
