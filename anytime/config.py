"""The recipe: a typed schema for a whole run, loaded from YAML with dotted overrides.

Defaults are the paper's values (AnytimeReasoner, R1-Distill-Qwen-1.5B, 8k thinking). Every
problem with a recipe is raised as `RecipeError` naming the key path and what is allowed; the CLI
prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from anytime import defaults
from anytime.algo import (
    BUDGET_PRIORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    SUMMARY_ESTIMATORS,
    THINKING_ESTIMATORS,
    VARIANCE_REDUCTIONS,
)
from anytime.algo.budget import even_grid, prior_probs, validate_grid
from anytime.core.schema import build
from anytime.errors import RecipeError
from anytime.learner import LEARNERS, LR_SCHEDULES
from anytime.pipeline import SCHEDULES
from anytime.registry import Choice
from anytime.rollout import ENGINES, PLACEMENTS

__all__ = ["Recipe", "RecipeError", "load_recipe"]


@dataclass
class ModelConfig:
    path: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"   # hub name or local folder
    dtype: Annotated[str, Choice(defaults.DTYPES)] = "bfloat16"
    trust_remote_code: bool = False
    # Build a random tiny model at `path` first when the folder does not exist (CPU quickstart).
    tiny: bool = False
    tiny_hidden_size: int = 128
    tiny_layers: int = 2
    tiny_heads: int = 2
    tiny_kv_heads: int = 1   # key/value heads (grouped-query attention when fewer than tiny_heads)
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    train: str = "agentica-org/DeepScaleR-Preview-Dataset"  # hub name, local json/jsonl/parquet, or "synthetic"
    split: str = "train"
    problem_key: str = "problem"
    answer_key: str = "answer"
    instruction: str = defaults.INSTRUCTION
    max_prompt_len: int = 1024
    shuffle: bool = True
    limit: int | None = None          # use only the first N rows (after shuffling)
    synthetic_size: int = 4000        # rows of the synthetic task (data.train: synthetic)
    synthetic_min_ops: int = 3
    synthetic_max_ops: int = 6
    synthetic_filler: float = 0.5     # chance of a filler line before each step in the SFT traces
    synthetic_whole_sums: bool = False  # SFT trace lines write whole sums (8+5=13), not last digits (8+5=3)


@dataclass
class RolloutConfig:
    engine: Annotated[str, Choice(ENGINES)] = "vllm"
    n: int = 8                          # G thinking traces per prompt
    prompts_per_step: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int | None = None    # default: prompt + thinking + summary
    gpu_memory_utilization: float = 0.6
    enable_sleep: bool = False           # engine sleeps during the learner update, wakes for the weight sync (GPU)
    # Where rollouts run: inprocess (one worker on learner rank 0), colocated (a worker on every learner
    # rank), ray (`workers` Ray actors); auto = inprocess with one learner process, else colocated.
    placement: Annotated[str, Choice(PLACEMENTS, "auto")] = "auto"
    workers: int = 1                     # Ray actors (placement: ray)
    ray_cpus_per_worker: float = 1.0
    ray_gpus_per_worker: float | None = None   # null: 1 when CUDA is available, else 0
    # Weights to Ray actors: through Ray's object store, or NCCL from learner rank 0 (GPU; auto picks it there)
    weight_sync: Literal["auto", "object_store", "nccl"] = "auto"
    pin_cpus: bool = True                # CPU engines: each worker takes its own share of the cores


@dataclass
class BudgetConfig:
    max_thinking: int = 8000
    num_budgets: int = 4                # evenly spaced up to max_thinking, unless `budgets` is given
    budgets: list[int] | None = None
    prior: Annotated[str, Choice(BUDGET_PRIORS)] = "linear"
    probs: list[float] | None = None    # for prior: explicit

    def grid(self) -> list[int]:
        return list(self.budgets) if self.budgets is not None else even_grid(self.max_thinking, self.num_budgets)

    def prior_probs(self) -> list[float]:
        return prior_probs(self.prior, self.grid(), self.probs)


@dataclass
class SummaryConfig:
    n: int = 4                          # A summaries per budget
    max_tokens: int = defaults.SUMMARY_MAX_TOKENS   # paper: 128 minus the ~10 inserted tokens
    close_text: str = defaults.CLOSE_TEXT
    header: str = defaults.HEADER
    think_end: str = defaults.THINK_END
    temperature: float = 1.0
    estimator: Annotated[str, Choice(SUMMARY_ESTIMATORS)] = "brpo"
    loss_weight: float = 1.0


@dataclass
class AlgorithmConfig:
    estimator: Annotated[str, Choice(THINKING_ESTIMATORS)] = "brpo"
    variance_reduction: Annotated[str, Choice(VARIANCE_REDUCTIONS)] = "brpo"
    decay: float = 0.5                  # λ of V1
    thinking_loss_weight: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: Annotated[str, Choice(LOSS_AGGREGATIONS)] = "constant"
    # Width of the `constant` normaliser (loss = Σ token terms / (traces × width)). The official
    # code uses its max_response_length, fixed per recipe: 10176 = 8000 + 16 × 136 for the 8k runs.
    # null derives it from each batch: largest budget + S·A·(inserted + summary tokens).
    loss_norm_length: int | None = None
    kl_coef: float = 0.0
    kl_type: Annotated[str, Choice(KL_ESTIMATORS)] = "k3"
    entropy_coef: float = 0.0


@dataclass
class PipelineConfig:
    stages: int = 1                     # pipeline ranks = learner processes; 1 = no pipeline
    schedule: Annotated[str, Choice(SCHEDULES)] = "zb-h1"
    microbatches: int = 8               # per PPO mini-batch (its rows are padded to a multiple)
    chunks: int | None = None           # model chunks per rank (V / interleaved); None = the schedule's default
    offload_chunks: list[int] = field(default_factory=list)   # chunks whose activations go to host memory
    # Speculative optimizer step, clip/inf checked afterwards (post-validation); null = the backend's
    # default: on for torch, off (the blocking step) for DeepSpeed.
    post_validate: bool | None = None

    def post_validating(self, backend: str) -> bool:
        return self.post_validate if self.post_validate is not None else backend == "torch"


@dataclass
class LearnerConfig:
    backend: Annotated[str, Choice(LEARNERS)] = "torch"
    num_processes: int = 1              # learner processes; with a pipeline: stages × data-parallel replicas
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_schedule: Annotated[str, Choice(LR_SCHEDULES)] = "constant"
    warmup_steps: int = 0
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    mini_batch_prompts: int = 32
    micro_batch_tokens: int = 16384
    pack_summaries: bool = True         # one tree-packed row per trace (summaries as branches) vs a row per summary
    logprob_chunk_tokens: int = 1024    # tokens per LM-head chunk: no [tokens × vocab] logits beyond one chunk
    zero_stage: int = 2
    bf16: bool = False
    reference_model: bool = False       # needed only with algorithm.kl_coef > 0
    deterministic: bool = False
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    @property
    def processes(self) -> int:
        """Learner processes to start: `num_processes`, or one per stage when it is left at 1."""
        return self.pipeline.stages if self.num_processes == 1 else self.num_processes


@dataclass
class SFTConfig:
    steps: int = 0                      # 0 = no supervised warm start
    lr: float = 3e-3
    batch_size: int = 32
    warmup_steps: int = 20
    lr_schedule: Annotated[str, Choice(LR_SCHEDULES)] = "cosine"   # after the warmup


@dataclass
class TrainerConfig:
    steps: int = 630
    seed: int = 0
    output_dir: str = "runs/anytime"
    save_every: int = 50
    keep_last: int = 3
    resume: str = "auto"                # auto | never | a checkpoint folder
    num_threads: int = 0                # CPU threads per process for torch; 0 = torch's default


@dataclass
class LoggingConfig:
    jsonl: bool = True
    tensorboard: bool = True            # used when the tensorboard package is installed
    wandb: bool = False
    wandb_project: str = "anytime"
    progress: bool = True


@dataclass
class EvalConfig:
    every: int = 20                     # steps; 0 = only before and after training
    budgets: list[int] | None = None    # default: the training grid
    benchmarks: list[str] = field(default_factory=lambda: ["aime24", "amc22"])
    data_dir: str | None = None         # local benchmark files instead of the hub
    samples: int = 1
    limit: int | None = None            # problems per benchmark
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int = 12345                   # sampling seed of the held-out eval (fixed across steps)
    max_sample_records: int = 200       # per-sample records kept per eval (eval_samples/step_N.jsonl); 0 = none


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict[str, Any]:
    """`rollout.n=8` → {"rollout": {"n": 8}}; the value is parsed as YAML (`[1, 2]`, `null`, `true`)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like key.path=value, e.g. rollout.n=8")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r} has an empty key; write e.g. budget.prior=uniform")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: value is not valid YAML ({exc.problem})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {str(path)!r} must hold a mapping of sections (model:, data:, ...)")
    parent = data.pop("base", None)   # `base: other.yaml` inherits and overrides another recipe
    if parent is not None:
        parent_path = (path.parent / str(parent)).resolve()
        if parent_path in seen:
            raise RecipeError(f"recipe {str(path)!r}: `base` chain loops through {str(parent_path)!r}")
        data = _merge(_load_yaml(parent_path, seen + (parent_path,)), data)
    return data


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe file (or the defaults when `path` is None), apply dotted overrides, validate."""
    data: dict[str, Any] = {} if path is None else _load_yaml(Path(path).resolve())
    for text in overrides:
        data = _merge(data, parse_override(text))
    return recipe_from_dict(data)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    recipe = build(Recipe, data)
    validate(recipe)
    return recipe


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def _check_grid(key: str, grid: list[int], max_thinking: int) -> None:
    try:
        validate_grid(grid, max_thinking, name=f"`{key}`", limit_name="`budget.max_thinking`")
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def validate(r: Recipe) -> None:
    """Cross-field checks, each naming the key to change."""
    b = r.budget
    _require(b.max_thinking > 0, f"`budget.max_thinking` must be positive, got {b.max_thinking}")
    _require(b.num_budgets > 0, f"`budget.num_budgets` must be positive, got {b.num_budgets}")
    if b.budgets is not None:
        _check_grid("budget.budgets", b.budgets, b.max_thinking)
    else:
        _require(b.num_budgets <= b.max_thinking,
                 f"`budget.num_budgets` ({b.num_budgets}) cannot exceed `budget.max_thinking` ({b.max_thinking})")
    if b.prior == "explicit":
        _require(b.probs is not None, "`budget.prior: explicit` needs `budget.probs` (one probability per budget)")
        n = len(b.grid())
        _require(len(b.probs) == n, f"`budget.probs` has {len(b.probs)} entries but there are {n} budgets")
        _require(all(p >= 0 for p in b.probs), f"`budget.probs` must be non-negative, got {b.probs}")
        _require(abs(sum(b.probs) - 1.0) <= 1e-6, f"`budget.probs` must sum to 1, got {sum(b.probs):.6g}")
    else:
        _require(b.probs is None, f"`budget.probs` is only used with `budget.prior: explicit` (prior is {b.prior!r})")
    _require(r.rollout.workers == 1 or r.rollout.placement == "ray",
             f"`rollout.workers` ({r.rollout.workers}) > 1 needs `rollout.placement: ray`; the colocated placement "
             "runs one worker per learner process (raise learner.num_processes)")
    _require(r.rollout.placement != "ray" or r.rollout.workers <= r.rollout.prompts_per_step,
             f"`rollout.workers` ({r.rollout.workers}) exceeds `rollout.prompts_per_step` "
             f"({r.rollout.prompts_per_step}): every worker needs a prompt")
    for key, value in (("rollout.n", r.rollout.n), ("rollout.prompts_per_step", r.rollout.prompts_per_step),
                       ("rollout.workers", r.rollout.workers),
                       ("summary.n", r.summary.n), ("summary.max_tokens", r.summary.max_tokens),
                       ("data.max_prompt_len", r.data.max_prompt_len), ("trainer.steps", r.trainer.steps),
                       ("learner.ppo_epochs", r.learner.ppo_epochs),
                       ("learner.mini_batch_prompts", r.learner.mini_batch_prompts),
                       ("learner.micro_batch_tokens", r.learner.micro_batch_tokens),
                       ("learner.logprob_chunk_tokens", r.learner.logprob_chunk_tokens),
                       ("learner.num_processes", r.learner.num_processes),
                       ("learner.pipeline.stages", r.learner.pipeline.stages),
                       ("learner.pipeline.microbatches", r.learner.pipeline.microbatches),
                       ("eval.samples", r.eval.samples)):
        _require(value > 0, f"`{key}` must be a positive integer, got {value}")
    _require(r.eval.max_sample_records >= 0,
             f"`eval.max_sample_records` must be >= 0 (0 writes no eval samples), got {r.eval.max_sample_records}")
    _require(r.rollout.temperature > 0, f"`rollout.temperature` must be > 0, got {r.rollout.temperature}")
    _require(r.eval.temperature >= 0, f"`eval.temperature` must be >= 0 (0 = greedy), got {r.eval.temperature}")
    _require(0 < r.rollout.top_p <= 1, f"`rollout.top_p` must be in (0, 1], got {r.rollout.top_p}")
    _require(r.learner.lr > 0, f"`learner.lr` must be > 0, got {r.learner.lr}")
    _require(r.learner.grad_clip >= 0, f"`learner.grad_clip` must be >= 0 (0 disables clipping), got {r.learner.grad_clip}")
    _require(r.learner.zero_stage in (0, 1, 2, 3), f"`learner.zero_stage` must be 0, 1, 2 or 3, got {r.learner.zero_stage}")
    _require(len(r.learner.betas) == 2 and all(0 <= x < 1 for x in r.learner.betas),
             f"`learner.betas` must be two numbers in [0, 1), got {r.learner.betas}")
    _require(0 <= r.algorithm.clip_low < 1, f"`algorithm.clip_low` must be in [0, 1), got {r.algorithm.clip_low}")
    _require(r.algorithm.clip_high >= 0, f"`algorithm.clip_high` must be >= 0, got {r.algorithm.clip_high}")
    _require(0 < r.algorithm.decay <= 1, f"`algorithm.decay` (λ) must be in (0, 1], got {r.algorithm.decay}")
    _require(r.algorithm.loss_norm_length is None or r.algorithm.loss_norm_length > 0,
             f"`algorithm.loss_norm_length` must be a positive token count or null, got {r.algorithm.loss_norm_length}")
    _require(r.algorithm.kl_coef == 0 or r.learner.reference_model,
             "`algorithm.kl_coef` > 0 needs `learner.reference_model: true`")
    _require(r.trainer.keep_last > 0, f"`trainer.keep_last` must be positive, got {r.trainer.keep_last}")
    _require(r.summary.think_end in r.summary.close_text,
             f"`summary.close_text` {r.summary.close_text!r} must contain `summary.think_end` {r.summary.think_end!r}")
    _require(r.summary.header.strip() != "", "`summary.header` must not be blank; the verifier looks for it")
    if r.rollout.max_model_len is not None:
        need = r.data.max_prompt_len + b.max_thinking
        _require(r.rollout.max_model_len >= need,
                 f"`rollout.max_model_len` ({r.rollout.max_model_len}) is below max_prompt_len + max_thinking "
                 f"({need}); raise it or lower `budget.max_thinking`")
    if r.eval.budgets is not None:
        _check_grid("eval.budgets", r.eval.budgets, b.max_thinking)
    _validate_pipeline(r)
    _require(r.data.synthetic_min_ops >= 1 and r.data.synthetic_min_ops <= r.data.synthetic_max_ops,
             "`data.synthetic_min_ops` must be >= 1 and <= `data.synthetic_max_ops`")
    _require(0 <= r.data.synthetic_filler < 1, f"`data.synthetic_filler` must be in [0, 1), got {r.data.synthetic_filler}")


def _validate_pipeline(r: Recipe) -> None:
    """`learner.pipeline.stages > 1`: a pipelined learner on P stages × D data-parallel replicas
    (`learner.num_processes` = P·D; 1 means one replica), torch or DeepSpeed ZeRO-1/2 per stage."""
    from anytime.pipeline.schedule import build_schedule

    p, lc = r.learner.pipeline, r.learner
    if p.stages == 1:
        return
    _require(lc.num_processes == 1 or lc.num_processes % p.stages == 0,
             f"`learner.num_processes` ({lc.num_processes}) must be a multiple of `learner.pipeline.stages` "
             f"({p.stages}): the learner runs stages × data-parallel replicas processes (e.g. "
             f"learner.num_processes={2 * p.stages} for 2 replicas), or leave it at 1 for one replica")
    _require(lc.backend == "torch" or lc.zero_stage in (1, 2),
             f"`learner.zero_stage` is {lc.zero_stage}, but DeepSpeed on the pipeline (`learner.pipeline.stages` > 1) "
             "supports ZeRO stages 1 and 2: set learner.zero_stage=1 or 2 (or learner.pipeline.stages=1 for ZeRO-3)")
    _require(p.microbatches >= p.stages,
             f"`learner.pipeline.microbatches` ({p.microbatches}) must be >= stages ({p.stages})")
    try:
        schedule = build_schedule(p.schedule, p.stages, p.microbatches, p.chunks)
    except ValueError as exc:
        raise RecipeError(f"`learner.pipeline`: {exc}") from None
    _require(all(0 <= c < schedule.chunks for c in p.offload_chunks),
             f"`learner.pipeline.offload_chunks` {p.offload_chunks} must be chunk indices in 0..{schedule.chunks - 1}")
    _require(not r.learner.reference_model and r.algorithm.kl_coef == 0,
             "`learner.pipeline.stages` > 1 does not support a reference model (`algorithm.kl_coef` > 0); "
             "set kl_coef: 0 and learner.reference_model: false, or learner.pipeline.stages: 1")
    _require(not r.model.gradient_checkpointing,
             "`model.gradient_checkpointing` is not supported with `learner.pipeline.stages` > 1; use "
             "`learner.pipeline.offload_chunks` to save activation memory")
