"""Every check of a recipe, each naming the key to change (`check_recipe`, run by `anytime.config`
when a recipe is loaded): value ranges, budgets, placement and staleness, the pipeline, LoRA,
precision and data. They read the recipe by attribute, so this module imports nothing from
`anytime.config`, which holds the schema."""

from __future__ import annotations

import functools
from typing import Any

from anytime.algo.budget import validate_grid
from anytime.config.answer_format import AnswerFormat
from anytime.config.placement_plan import placement_plan
from anytime.errors import RecipeError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def check_rollout(r: Any) -> None:
    """`rollout`: where workers run, staleness and in-flight updates (r: an `anytime.config.Recipe`); the
    placement plan's own refusals (`anytime.config.placement_plan`) raise here too."""
    plan = placement_plan(r)
    placement, apart = plan.placement, plan.apart
    require(r.rollout.workers == 1 or apart, f"`rollout.workers` ({r.rollout.workers}) > 1 needs `rollout.placement: "
            "ray` or `processes`; colocated runs one worker per learner process (raise learner.num_processes)")
    k, shared = r.rollout.max_staleness, placement == "colocated"
    require(not shared or r.rollout.prompts_per_step >= r.learner.processes,
            f"`rollout.placement: colocated` gives each of the {r.learner.processes} learner processes a share of "
            f"`rollout.prompts_per_step` ({r.rollout.prompts_per_step}); raise it to >= {r.learner.processes}")
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
    # `auto` may resolve to float32 on the run's device (no native bf16): only an explicit true keeps the copy
    require(not (r.learner.backend == "deepspeed" and r.learner.zero_stage == 0 and r.learner.bf16 is not True),
            f"DeepSpeed ZeRO-0 without `learner.bf16: true` would step `model.dtype: {r.model.dtype}` weights with "
            "no float32 copy, losing small updates: set learner.bf16=true, learner.zero_stage >= 1, or "
            "model.dtype=float32")


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
    from anytime.tasks.reasoning_gym import TaskError, check_task, make_dataset, task_name

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


def _check_grid(key: str, grid: list[int], max_thinking: int) -> None:
    try:
        validate_grid(grid, max_thinking, name=f"`{key}`", limit_name="`budget.max_thinking`")
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def check_recipe(r: Any) -> None:
    """Cross-field checks, each naming the key to change."""
    b = r.budget
    require(b.max_thinking > 0, f"`budget.max_thinking` must be positive, got {b.max_thinking}")
    require(b.num_budgets > 0, f"`budget.num_budgets` must be positive, got {b.num_budgets}")
    if b.budgets is not None:
        _check_grid("budget.budgets", b.budgets, b.max_thinking)
    else:
        require(b.num_budgets <= b.max_thinking,
                 f"`budget.num_budgets` ({b.num_budgets}) cannot exceed `budget.max_thinking` ({b.max_thinking})")
    if b.prior == "explicit":
        require(b.probs is not None, "`budget.prior: explicit` needs `budget.probs` (one probability per budget)")
        n = len(b.grid())
        require(len(b.probs) == n, f"`budget.probs` has {len(b.probs)} entries but there are {n} budgets")
        require(all(p >= 0 for p in b.probs), f"`budget.probs` must be non-negative, got {b.probs}")
        require(abs(sum(b.probs) - 1.0) <= 1e-6, f"`budget.probs` must sum to 1, got {sum(b.probs):.6g}")
    else:
        require(b.probs is None, f"`budget.probs` is only used with `budget.prior: explicit` (prior is {b.prior!r})")
    check_rollout(r)
    for key in ("rollout.n", "rollout.prompts_per_step", "rollout.workers", "summary.n", "summary.max_tokens",
                "data.max_prompt_len", "trainer.steps", "learner.ppo_epochs", "learner.mini_batch_prompts",
                "learner.micro_batch_tokens", "learner.logprob_chunk_tokens", "learner.num_processes",
                "learner.pipeline.stages", "learner.pipeline.microbatches", "eval.samples",
                "rollout.dynamic_sampling_max_draws"):
        value = functools.reduce(getattr, key.split("."), r)
        require(value > 0, f"`{key}` must be a positive integer, got {value}")
    require(r.eval.max_sample_records >= 0,
             f"`eval.max_sample_records` must be >= 0 (0 writes no eval samples), got {r.eval.max_sample_records}")
    require(r.rollout.temperature > 0, f"`rollout.temperature` must be > 0, got {r.rollout.temperature}")
    require(r.eval.temperature >= 0, f"`eval.temperature` must be >= 0 (0 = greedy), got {r.eval.temperature}")
    require(0 < r.rollout.top_p <= 1, f"`rollout.top_p` must be in (0, 1], got {r.rollout.top_p}")
    require(r.learner.lr > 0, f"`learner.lr` must be > 0, got {r.learner.lr}")
    require(r.learner.grad_clip >= 0, f"`learner.grad_clip` must be >= 0 (0 = no clipping), got {r.learner.grad_clip}")
    stage = r.learner.zero_stage
    require(stage in (0, 1, 2, 3), f"`learner.zero_stage` must be 0, 1, 2 or 3, got {stage}")
    require(len(r.learner.betas) == 2 and all(0 <= x < 1 for x in r.learner.betas),
             f"`learner.betas` must be two numbers in [0, 1), got {r.learner.betas}")
    require(0 <= r.algorithm.clip_low < 1, f"`algorithm.clip_low` must be in [0, 1), got {r.algorithm.clip_low}")
    require(r.algorithm.clip_high >= 0, f"`algorithm.clip_high` must be >= 0, got {r.algorithm.clip_high}")
    require(0 < r.algorithm.decay <= 1, f"`algorithm.decay` (λ) must be in (0, 1], got {r.algorithm.decay}")
    require(r.algorithm.loss_norm_length is None or r.algorithm.loss_norm_length > 0,
             f"`algorithm.loss_norm_length` must be a positive token count or null, got {r.algorithm.loss_norm_length}")
    require(r.algorithm.is_cap > 0, f"`algorithm.is_cap` must be > 0 (.inf for no cap), got {r.algorithm.is_cap}")
    require(r.algorithm.kl_coef == 0 or r.learner.reference_model,
             "`algorithm.kl_coef` > 0 needs `learner.reference_model: true`")
    require(r.trainer.keep_last > 0, f"`trainer.keep_last` must be positive, got {r.trainer.keep_last}")
    require(r.trainer.dist_timeout_minutes > 0,
             f"`trainer.dist_timeout_minutes` must be positive, got {r.trainer.dist_timeout_minutes}")
    AnswerFormat.from_recipe(r)   # the answer format's own rules (`summary.*`), each naming its key
    if r.rollout.max_model_len is not None:
        need = r.data.max_prompt_len + b.max_thinking
        require(r.rollout.max_model_len >= need,
                 f"`rollout.max_model_len` ({r.rollout.max_model_len}) is below max_prompt_len + max_thinking "
                 f"({need}); raise it or lower `budget.max_thinking`")
    if r.eval.budgets is not None:
        _check_grid("eval.budgets", r.eval.budgets, b.max_thinking)
    _check_pipeline(r)
    check_lora(r)
    check_old_logprobs(r)
    check_precision(r)
    require(r.data.synthetic_min_ops >= 1 and r.data.synthetic_min_ops <= r.data.synthetic_max_ops,
             "`data.synthetic_min_ops` must be >= 1 and <= `data.synthetic_max_ops`")
    filler = r.data.synthetic_filler
    require(0 <= filler < 1, f"`data.synthetic_filler` must be in [0, 1), got {filler}")
    check_data(r)


def _check_pipeline(r: Any) -> None:
    """`learner.pipeline.stages > 1`: a pipelined learner on P stages × D data-parallel replicas
    (`learner.num_processes` = P·D; 1 means one replica), torch or DeepSpeed ZeRO-1/2 per stage."""
    from anytime.pipeline.schedule import build_schedule

    p, lc = r.learner.pipeline, r.learner
    if p.stages == 1:
        return
    require(lc.num_processes == 1 or lc.num_processes % p.stages == 0,
             f"`learner.num_processes` ({lc.num_processes}) must be a multiple of `learner.pipeline.stages` "
             f"({p.stages}): the learner runs stages × data-parallel replicas processes (e.g. "
             f"learner.num_processes={2 * p.stages} for 2 replicas), or leave it at 1 for one replica")
    require(lc.backend == "torch" or lc.zero_stage in (1, 2),
             f"`learner.zero_stage` is {lc.zero_stage}, but DeepSpeed on the pipeline (`learner.pipeline.stages` > 1) "
             "supports ZeRO stages 1 and 2: set learner.zero_stage=1 or 2 (or learner.pipeline.stages=1 for ZeRO-3)")
    require(p.microbatches >= p.stages,
             f"`learner.pipeline.microbatches` ({p.microbatches}) must be >= stages ({p.stages})")
    try:
        schedule = build_schedule(p.schedule, p.stages, p.microbatches, p.chunks)
    except ValueError as exc:
        raise RecipeError(f"`learner.pipeline`: {exc}") from None
    require(all(0 <= c < schedule.chunks for c in p.offload_chunks),
             f"`learner.pipeline.offload_chunks` {p.offload_chunks} must be chunk indices in 0..{schedule.chunks - 1}")
    require(not r.learner.reference_model and r.algorithm.kl_coef == 0,
             "`learner.pipeline.stages` > 1 does not support a reference model (`algorithm.kl_coef` > 0); "
             "set kl_coef: 0 and learner.reference_model: false, or learner.pipeline.stages: 1")
    require(not r.model.gradient_checkpointing,
             "`model.gradient_checkpointing` is not supported with `learner.pipeline.stages` > 1; use "
             "`learner.pipeline.offload_chunks` to save activation memory")
