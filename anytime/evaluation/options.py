"""What `anytime eval` runs with: built-in defaults, then a training recipe's eval settings
(`--recipe`), then the flags given on the command line; and models given as training checkpoints,
exported on the fly.

A recipe supplies what the trainer's in-training eval uses, so offline numbers match the ones logged
during training: budgets (`eval.budgets`, else the training grid), one summary per budget of
`summary.max_tokens` with `summary.close_text` / `header` / `think_end`, sampled at
`eval.temperature` like the thinking; `data.instruction`, `data.max_prompt_len`, `eval.benchmarks`,
`eval.samples`, `eval.top_p`, `eval.seed` (the sampling seed), `eval.data_dir`, `eval.limit`,
`model.dtype`, `rollout.engine` and `trainer.seed` (which held-out synthetic problems). Every training
run saves its resolved recipe as `recipe.yaml`, so `anytime eval --recipe RUN/recipe.yaml --model
RUN/checkpoints/step_N` scores a checkpoint exactly as the run's own eval did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime import defaults

log = logging.getLogger(__name__)

DEFAULT_BENCHMARKS = ("aime24", "amc22", "math500", "minerva", "olympiadbench")
EXPORT_TOLERANCE = 1e-5   # max abs log-prob difference between a checkpoint and its export


@dataclass(frozen=True)
class EvalOptions:
    """Every setting of an eval run that a recipe or a flag can set (flag names: `--` + dashes)."""

    benchmarks: tuple[str, ...] = DEFAULT_BENCHMARKS
    budgets: tuple[int, ...] = tuple(range(250, 8001, 250))
    samples: int = 1                      # thinking traces per problem
    summaries: int = 1                    # summaries per budget
    summary_max_tokens: int = defaults.SUMMARY_MAX_TOKENS
    close_text: str = defaults.CLOSE_TEXT
    header: str = defaults.HEADER
    think_end: str = defaults.THINK_END
    instruction: str = defaults.INSTRUCTION
    temperature: float = 0.6              # 0 = greedy
    summary_temperature: float | None = None   # None: the thinking temperature
    top_p: float = 0.95
    seed: int = 0                         # picks the synthetic benchmark's problems; a run's trainer.seed
    sample_seed: int | None = None        # of the sampled traces and summaries; None: `seed`
    max_prompt_len: int = 1024
    data_dir: str | None = None
    limit: int | None = None
    dtype: str = "bfloat16"
    engine: str = "vllm"
    eos_ends_thinking: bool = False       # instruct models: EOS closes the thinking (summary.eos_ends_thinking)
    # a recipe's procedural task (`data.train: reasoning_gym:<task>`): its knobs and training split,
    # so that `eval.benchmarks: [reasoning_gym:<task>]` is the held-out split the run's own eval scores
    train_task: str | None = None
    task_config: tuple[tuple[str, Any], ...] = ()
    task_size: int = 0

    @property
    def sampling_seed(self) -> int:
        return self.seed if self.sample_seed is None else self.sample_seed

    def settings(self, seed: int) -> Any:
        """The rollout settings (`AnytimeSettings`) of this eval."""
        from anytime.rollout.settings import AnytimeSettings

        summary_temperature = self.temperature if self.summary_temperature is None else self.summary_temperature
        return AnytimeSettings(tuple(self.budgets), self.samples, self.summaries, self.summary_max_tokens,
                               close_text=self.close_text, header=self.header, think_end=self.think_end,
                               temperature=self.temperature, top_p=self.top_p,
                               summary_temperature=summary_temperature, seed=seed,
                               eos_ends_thinking=self.eos_ends_thinking)


def recipe_options(recipe: Any) -> dict[str, Any]:
    """The eval settings of a training recipe, as the trainer's in-training eval uses them."""
    ev, summary = recipe.eval, recipe.summary
    return dict(benchmarks=tuple(ev.benchmarks), budgets=tuple(ev.budgets or recipe.budget.grid()),
                samples=ev.samples, summaries=1, summary_max_tokens=summary.max_tokens,
                close_text=summary.close_text, header=summary.header, think_end=summary.think_end,
                instruction=recipe.data.instruction, temperature=ev.temperature, top_p=ev.top_p,
                seed=recipe.trainer.seed, sample_seed=ev.seed,
                max_prompt_len=recipe.data.max_prompt_len, data_dir=ev.data_dir, limit=ev.limit,
                dtype=recipe.model.dtype, engine=recipe.rollout.engine, eos_ends_thinking=summary.eos_ends_thinking,
                train_task=recipe.data.train, task_config=tuple(sorted(recipe.data.task_config.items())),
                task_size=recipe.data.task_size)


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `EvalOptions` field; default None so that only flags really given override."""
    d = EvalOptions()
    parser.add_argument("--recipe", default=None,
                        help="take budgets, summary settings, instruction, benchmarks, samples, temperature/top_p, "
                             "data dir, dtype and engine from this training recipe (flags given here still win)")
    parser.add_argument("--benchmarks", default=None, help=f"comma list (default {','.join(d.benchmarks)})")
    parser.add_argument("--budgets", default=None, help="START:STOP:STEP or a comma list (default 250:8000:250)")
    parser.add_argument("--samples", type=int, default=None, help="thinking traces per problem (default 1)")
    parser.add_argument("--summaries", type=int, default=None, help="summaries per budget (default 1)")
    parser.add_argument("--summary-max-tokens", type=int, default=None, help=f"default {d.summary_max_tokens}")
    parser.add_argument("--close-text", default=None, help=f"forced close of a cut trace (default {d.close_text!r})")
    parser.add_argument("--header", default=None, help=f"answer header after the thinking (default {d.header!r})")
    parser.add_argument("--think-end", default=None, help=f"the model's end-of-thinking marker (default {d.think_end!r})")
    parser.add_argument("--instruction", default=None, help="appended to every problem (default: the boxed-answer one)")
    parser.add_argument("--temperature", type=float, default=None, help=f"0 = greedy (default {d.temperature})")
    parser.add_argument("--summary-temperature", type=float, default=None, help="default: --temperature")
    parser.add_argument("--top-p", type=float, default=None, help=f"default {d.top_p}")
    parser.add_argument("--seed", type=int, default=None,
                        help="picks the synthetic benchmark's held-out problems (default 0; a recipe's trainer.seed)")
    parser.add_argument("--sample-seed", type=int, default=None,
                        help="seed of the sampled traces and summaries (default: --seed; a recipe's eval.seed)")
    parser.add_argument("--max-prompt-len", type=int, default=None, help=f"default {d.max_prompt_len}")
    parser.add_argument("--data-dir", default=None, help="local benchmark files instead of the hub")
    parser.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    parser.add_argument("--dtype", default=None, help=f"default {d.dtype}")
    parser.add_argument("--engine", choices=["hf", "vllm"], default=None, help=f"default {d.engine}")
    parser.add_argument("--eos-ends-thinking", action="store_true", default=None,
                        help="instruct models without a thinking format: force the summary at a trace's EOS instead of "
                             "scoring the budgets past it 0")


def resolve_options(args: argparse.Namespace) -> EvalOptions:
    """Defaults ← the recipe's eval settings (`--recipe`) ← the flags given."""
    values: dict[str, Any] = {}
    if getattr(args, "recipe", None):
        from anytime.config import load_recipe

        values.update(recipe_options(load_recipe(args.recipe)))
    for f in dataclasses.fields(EvalOptions):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name == "benchmarks":
            value = tuple(b.strip() for b in value.split(",") if b.strip())
        elif f.name == "budgets":
            from anytime.algo.budget import parse_grid

            value = tuple(parse_grid(value))
        values[f.name] = value
    opts = EvalOptions(**values)
    if opts.think_end not in opts.close_text:
        # the verifier reads from the one `think_end` on: a close without it scores every cut 0
        raise ValueError(f"--close-text {opts.close_text!r} must contain --think-end {opts.think_end!r}")
    return opts


# --- models given as training checkpoints --------------------------------------------------------

def _adapter_config(model: str) -> Path | None:
    """adapter_config.json of a LoRA checkpoint (`step_N/adapter/`) or of a PEFT adapter folder."""
    path = Path(model)
    return next((f for f in (path / "adapter" / "adapter_config.json", path / "adapter_config.json") if f.is_file()),
                None)


def is_checkpoint(model: str) -> bool:
    """A learner checkpoint (`step_N/` with `model/`, a DeepSpeed or a LoRA checkpoint) or a PEFT adapter
    folder: something to export before an engine can load it, not a HF folder."""
    path = Path(model)
    return path.is_dir() and ((path / "model" / "config.json").is_file() or (path / "deepspeed").is_dir()
                              or _adapter_config(model) is not None)


def config_folder(model: str) -> str:
    """Where the model's config.json lives: a checkpoint keeps it in `model/`; an adapter's is its base
    model's (the folder its adapter_config.json names)."""
    adapter_config = _adapter_config(model)
    if adapter_config is not None:
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{adapter_config} names no base_model_name_or_path; the adapter cannot be loaded")
        return str(base)
    return str(Path(model) / "model") if is_checkpoint(model) and (Path(model) / "model").is_dir() else model


def model_max_len(model: str) -> int | None:
    """The model's max_position_embeddings (None when the config has none)."""
    from transformers import AutoConfig

    try:
        return int(getattr(AutoConfig.from_pretrained(config_folder(model)), "max_position_embeddings", 0)) or None
    except OSError as exc:
        hint = ""
        if Path(model).is_dir() and any(Path(model).glob("step_*")):
            hint = "; it holds step_* checkpoints: pass one of them, e.g. --model " + str(sorted(Path(model).glob("step_*"))[-1])
        raise FileNotFoundError(f"model {model!r} not found (neither a model folder, a training checkpoint nor a "
                                f"reachable hub name){hint}: {exc}") from None


def summary_room(model: str, opts: EvalOptions) -> int:
    """Tokens a summary request adds after the thinking under `model`'s tokenizer: the inserted
    close and header, and the summary itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config_folder(model))
    inserted = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (opts.close_text, opts.header))
    return inserted + opts.summary_max_tokens


@contextmanager
def model_folder(model: str, scratch: str | Path) -> Iterator[str]:
    """A folder the engines can load: `model` itself, or for a training checkpoint a temporary export
    (under `scratch`, which is usually on a roomier disk than /tmp) removed on exit."""
    if not is_checkpoint(model):
        yield model
        return
    from anytime.learner.export import export_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=scratch))
    try:
        path, diff = export_checkpoint(model, tmp / "model")
        if diff > EXPORT_TOLERANCE:
            raise ValueError(f"checkpoint {model!r} exported with a log-prob difference of {diff:.3e} "
                             f"> {EXPORT_TOLERANCE}; run `anytime export {model} --out DIR` to inspect it")
        log.info("exported checkpoint %s for evaluation (log-prob parity %.1e)", model, diff)
        yield str(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
