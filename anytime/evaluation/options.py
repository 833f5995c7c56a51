"""What `anytime eval` runs with: the defaults, then a training recipe's eval settings (`--recipe`),
then the flags given on the command line; and models given as training checkpoints, exported on the fly.

Each option (`EvalOptions`) is either a recipe key's (`recipe_key`), whose default and flag help are
read from that key's field of the recipe schema (`anytime.config`) and which `--recipe` sets from that
key, or the eval's own (`eval_only`). A recipe supplies what the trainer's in-training eval uses, so
offline numbers match the ones logged during training: one summary per budget, sampled at
`eval.temperature` like the thinking; the budgets are `eval.budgets`, else the training grid. Without
a recipe three defaults are the standalone eval's own: the paper's five benchmarks and its 250:8000:250
budgets, and the sampling seed `--seed`. Every training run saves its resolved recipe as `recipe.yaml`,
so `anytime eval --recipe RUN/recipe.yaml --model RUN/checkpoints/step_N` scores a checkpoint exactly
as the run's own eval did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import tempfile
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime.config import Recipe, load_recipe
from anytime.config.answer_format import AnswerFormat, eval_budgets
from anytime.config.schema import field_at, field_choices, field_default

log = logging.getLogger(__name__)

DEFAULT_BENCHMARKS = ("aime24", "amc22", "math500", "minerva", "olympiadbench")
EXPORT_TOLERANCE = 1e-5   # max abs log-prob difference between a checkpoint and its export


# --- the options, each a recipe key's or the eval's own ------------------------------------------

def _frozen(value: Any) -> Any:
    """A recipe value as an `EvalOptions` field holds it: lists as tuples, mappings as sorted pairs."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return value


def schema_default(key: str) -> Any:
    """The recipe schema's default of a dotted key, frozen (`_frozen`)."""
    return _frozen(field_default(field_at(Recipe, key)[0]))


def recipe_key(key: str, *, default: Any = dataclasses.MISSING, note: str = "", flag: bool = True) -> Any:
    """An option the recipe key `key` sets (`--recipe`): its default and its flag's help are the
    schema field's. `default` only where the standalone eval deliberately differs (the flag's help
    says so); `note` adds what the flag alone needs said; `flag=False`: set by a recipe only."""
    own = default is not dataclasses.MISSING
    return dataclasses.field(default=default if own else schema_default(key),
                             metadata={"key": key, "own_default": own, "note": note, "flag": flag})


def eval_only(default: Any, help: str) -> Any:
    """An option of the eval alone, no recipe key's: its own default and help."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": True})


@dataclass(frozen=True)
class EvalOptions:
    """Every setting of an eval run that a recipe or a flag can set (flag names: `--` + dashes)."""

    benchmarks: tuple[str, ...] = recipe_key(
        "eval.benchmarks", default=DEFAULT_BENCHMARKS, note="a comma list")
    budgets: tuple[int, ...] = recipe_key(
        "eval.budgets", default=tuple(range(250, 8001, 250)), note="START:STOP:STEP or a comma list")
    samples: int = recipe_key("eval.samples")
    summaries: int = eval_only(1, "summaries per budget (default 1, as in the in-training eval; summary.n is "
                                  "training's)")
    summary_max_tokens: int = recipe_key("summary.max_tokens")
    close_text: str = recipe_key("summary.close_text")
    header: str = recipe_key("summary.header")
    think_end: str = recipe_key("summary.think_end")
    instruction: str = recipe_key("data.instruction")
    temperature: float = recipe_key("eval.temperature")
    summary_temperature: float | None = eval_only(
        None, "sampling temperature of the summaries (default: --temperature; summary.temperature is training's)")
    top_p: float = recipe_key("eval.top_p")
    seed: int = recipe_key("trainer.seed", note="here: which held-out synthetic / task problems, and the "
                                                "sampling seed unless --sample-seed")
    sample_seed: int | None = recipe_key("eval.seed", default=None, note="without --recipe: --seed")
    max_prompt_len: int = recipe_key("data.max_prompt_len")
    data_dir: str | None = recipe_key("eval.data_dir")
    limit: int | None = recipe_key("eval.limit")
    dtype: str = recipe_key("model.dtype")
    engine: str = recipe_key("rollout.engine")
    gpu_memory_utilization: float = recipe_key("rollout.gpu_memory_utilization")
    eos_ends_thinking: bool = recipe_key("summary.eos_ends_thinking")
    # a recipe's procedural task (`data.train: reasoning_gym:<task>`): its knobs and training split,
    # so that `eval.benchmarks: [reasoning_gym:<task>]` is the held-out split the run's own eval scores;
    # without a recipe there is no training split to avoid
    train_task: str | None = recipe_key("data.train", default=None, flag=False)
    task_config: tuple[tuple[str, Any], ...] = recipe_key("data.task_config", flag=False)
    task_size: int = recipe_key("data.task_size", default=0, flag=False)
    # the synthetic task's sizes: held-out problems like the recipe's training ones
    synthetic_min_ops: int = recipe_key("data.synthetic_min_ops", flag=False)
    synthetic_max_ops: int = recipe_key("data.synthetic_max_ops", flag=False)

    @property
    def sampling_seed(self) -> int:
        return self.seed if self.sample_seed is None else self.sample_seed

    def engine_kwargs(self) -> dict[str, Any]:
        """The eval engine's own arguments: a vLLM engine on a GPU takes the memory share asked for and never
        sleeps (no learner shares its GPU), so it starts without sleep mode and its allocator."""
        if self.engine != "vllm":
            return {}
        return {"gpu_memory_utilization": self.gpu_memory_utilization, "enable_sleep_mode": False}

    def answer_format(self) -> AnswerFormat:
        """The answer format of these options (their summary.* keys), validated by `AnswerFormat`."""
        return AnswerFormat(think_end=self.think_end, close_text=self.close_text, header=self.header,
                            summary_max_tokens=self.summary_max_tokens, eos_ends_thinking=self.eos_ends_thinking)

    def settings(self, seed: int) -> Any:
        """The rollout settings (`AnytimeSettings`) of this eval."""
        from anytime.rollout.settings import AnytimeSettings

        summary_temperature = self.temperature if self.summary_temperature is None else self.summary_temperature
        return AnytimeSettings(tuple(self.budgets), self.samples, self.summaries, self.answer_format(),
                               temperature=self.temperature, top_p=self.top_p,
                               summary_temperature=summary_temperature, seed=seed)


def option_default(f: dataclasses.Field) -> Any:
    """An option's default as of now: the schema's (read again, not the copy taken at import), or
    the option's own."""
    key = f.metadata.get("key")
    return schema_default(key) if key and not f.metadata["own_default"] else f.default


def recipe_options(recipe: Recipe) -> dict[str, Any]:
    """The eval settings of a training recipe, as the trainer's in-training eval uses them: every
    option's recipe key (the budgets: `eval.budgets`, else the training grid)."""
    values = {}
    for f in dataclasses.fields(EvalOptions):
        if "key" in f.metadata:
            value = recipe
            for part in f.metadata["key"].split("."):
                value = getattr(value, part)
            values[f.name] = _frozen(value)
    values["budgets"] = tuple(eval_budgets(recipe))
    return values


# --- the flags -----------------------------------------------------------------------------------

def _shown(value: Any) -> str:
    if isinstance(value, tuple) and len(value) > 2 and all(isinstance(v, int) for v in value) and \
            len({b - a for a, b in zip(value, value[1:])}) == 1:
        return f"{value[0]}:{value[-1]}:{value[1] - value[0]}"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value)


def option_help(f: dataclasses.Field) -> str:
    """A flag's help: a recipe key's is its schema field's meaning, then the key and the default."""
    if "key" not in f.metadata:
        return f.metadata["help"]
    key, note = f.metadata["key"], f.metadata["note"]
    default = option_default(f)
    text = field_at(Recipe, key)[0].metadata.get("doc", "") + (f"; {note}" if note else "")
    own = "the standalone eval's " if f.metadata["own_default"] else ""
    tail = f"recipe key {key}" + ("" if default is None else f"; {own}default {_shown(default)}")
    return f"{text} ({tail})"


def _flag_kind(f: dataclasses.Field, tp: Any) -> dict[str, Any]:
    """argparse's type, choices or action of an option of type `tp` (choices: the schema field's)."""
    if tp is bool:
        return {"action": "store_true"}
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    kind: dict[str, Any] = {"type": tp} if tp in (int, float) else {}
    choices = field_choices(field_at(Recipe, f.metadata["key"])[1]) if "key" in f.metadata else None
    if choices is not None:
        kind["choices"] = list(choices)
    return kind


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `EvalOptions` option (`flag`); default None so that only flags really given override."""
    parser.add_argument("--recipe", default=None,
                        help="take budgets, summary settings, instruction, benchmarks, samples, temperature/top_p, "
                             "data dir, dtype and engine from this training recipe (flags given here still win)")
    hints = typing.get_type_hints(EvalOptions)
    for f in dataclasses.fields(EvalOptions):
        if f.metadata["flag"]:
            parser.add_argument("--" + f.name.replace("_", "-"), default=None,
                                help=option_help(f).replace("%", "%%"), **_flag_kind(f, hints[f.name]))


def resolve_options(args: argparse.Namespace) -> EvalOptions:
    """Defaults ← the recipe's eval settings (`--recipe`) ← the flags given."""
    values: dict[str, Any] = {f.name: option_default(f) for f in dataclasses.fields(EvalOptions)}
    if getattr(args, "recipe", None):
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
    opts.answer_format()   # a format serving cannot honour is refused here, as at recipe load
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
    """Tokens a summary request adds after the thinking under `model`'s tokenizer
    (`AnswerFormat.room_after_cut`)."""
    from transformers import AutoTokenizer

    return opts.answer_format().room_after_cut(AutoTokenizer.from_pretrained(config_folder(model)))


@contextmanager
def model_folder(model: str, scratch: str | Path) -> Iterator[str]:
    """A folder the engines can load: `model` itself, or for a training checkpoint a temporary export
    (under `scratch`, which is usually on a roomier disk than /tmp) removed on exit."""
    if not is_checkpoint(model):
        yield model
        return
    from anytime.serving.export import export_checkpoint

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
