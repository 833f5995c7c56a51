"""`anytime eval`'s options have one source: a flag that a recipe key sets takes that key's default,
meaning and allowed values from the recipe schema (`anytime.config`), and the eval's own flags
repeat no recipe key."""

import argparse
import dataclasses

import pytest

from anytime.config import Recipe, schema_keys
from anytime.config.schema import field_at, field_choices, field_default
from anytime.evaluation.options import EvalOptions, _frozen, add_option_arguments, resolve_options

pytestmark = pytest.mark.unit


def _parser():
    parser = argparse.ArgumentParser()
    add_option_arguments(parser)
    return parser


def _flags():
    return {action.dest: action for action in _parser()._actions}


def _args(*argv):
    return _parser().parse_args(list(argv))


def _recipe_options():
    return [f for f in dataclasses.fields(EvalOptions) if "key" in f.metadata]


def test_every_recipe_flag_has_the_schema_fields_default_help_and_choices():
    flags, plain = _flags(), resolve_options(_args())
    assert plain == EvalOptions()
    for f in _recipe_options():
        field, tp = field_at(Recipe, f.metadata["key"])
        schema = _frozen(field_default(field))
        # a default of its own only where declared (and said in the help), and then really different
        assert (getattr(plain, f.name) != schema) == f.metadata["own_default"], f.name
        if not f.metadata["flag"]:
            assert f.name not in flags
            continue
        flag = flags[f.name]
        assert flag.default is None   # only flags really given override a recipe
        help_text = flag.help.replace("%%", "%")
        assert help_text.startswith(field.metadata["doc"]), f.name
        assert f"recipe key {f.metadata['key']}" in help_text
        if not f.metadata["own_default"] and schema is not None:
            assert f"default {schema!r}" in help_text or f"default {schema}" in help_text, f.name
        choices = field_choices(tp)
        assert flag.choices == (list(choices) if choices is not None else None), f.name


def test_the_eval_only_flags_repeat_no_recipe_key():
    keys, flags = schema_keys(), _flags()
    own = [f for f in dataclasses.fields(EvalOptions) if "key" not in f.metadata]
    assert own, "the eval has options of its own (e.g. --summaries)"
    for f in own:
        assert not [k for k in keys if k.endswith("." + f.name)], f.name
        assert flags[f.name].help == f.metadata["help"]


def test_a_changed_schema_field_reaches_the_flag(monkeypatch):
    """The flags read the schema when they are built: a schema default or meaning changed (here in a
    patched copy of `eval.temperature` and `summary.max_tokens`) is what `anytime eval` uses and says."""
    temperature, _ = field_at(Recipe, "eval.temperature")
    max_tokens, _ = field_at(Recipe, "summary.max_tokens")
    monkeypatch.setattr(temperature, "default", 0.3)
    monkeypatch.setattr(temperature, "metadata", {**temperature.metadata, "doc": "a changed meaning, 100% new"})
    monkeypatch.setattr(max_tokens, "default", 77)
    opts = resolve_options(_args())
    assert (opts.temperature, opts.summary_max_tokens) == (0.3, 77)
    flags = _flags()
    assert flags["temperature"].help == "a changed meaning, 100%% new (recipe key eval.temperature; default 0.3)"
    assert flags["summary_max_tokens"].help.endswith("(recipe key summary.max_tokens; default 77)")
    _parser().format_help()   # argparse formats the help ('%' escaped)
    assert resolve_options(_args("--temperature", "0.9")).temperature == 0.9   # a flag given still wins


def test_a_recipes_synthetic_sizes_reach_the_eval(tmp_path):
    """`anytime eval --recipe` draws held-out synthetic problems the size of the recipe's training ones
    (`data.synthetic_min_ops/max_ops`), as the in-training eval does."""
    from anytime.data.benchmarks import load_benchmark

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  synthetic_min_ops: 1\n  synthetic_max_ops: 2\n")
    args = _args()
    args.recipe = str(recipe)
    opts = resolve_options(args)
    assert (opts.synthetic_min_ops, opts.synthetic_max_ops) == (1, 2)
    plain = resolve_options(_args())
    assert (plain.synthetic_min_ops, plain.synthetic_max_ops) == (
        field_default(field_at(Recipe, "data.synthetic_min_ops")[0]),
        field_default(field_at(Recipe, "data.synthetic_max_ops")[0]))
    rows = load_benchmark("synthetic", limit=20, synthetic_ops=(opts.synthetic_min_ops, opts.synthetic_max_ops))
    assert max(row.problem.count("+") for row in rows) <= 2


def test_the_eval_engine_never_sleeps_and_takes_the_gpu_memory_share_asked_for(monkeypatch):
    """Round 6, finding 7: `anytime eval` started vLLM with sleep mode (and its allocator) on a GPU for an
    engine that never sleeps, at a fixed 0.5 of the GPU. Its engine gets the share the flag (or the
    recipe's rollout.gpu_memory_utilization) asks for and no sleep mode; an hf engine gets neither."""
    import anytime.rollout.engines.engine as engines
    from anytime.evaluation.evaluate import _evaluate_model

    opts = resolve_options(_args("--engine", "vllm", "--gpu-memory-utilization", "0.85"))
    assert opts.engine_kwargs() == {"gpu_memory_utilization": 0.85, "enable_sleep_mode": False}
    assert resolve_options(_args("--engine", "hf")).engine_kwargs() == {}
    seen = {}

    class Started(Exception):
        pass

    def create_engine(kind, folder, **kwargs):
        seen.update(kind=kind, **kwargs)
        raise Started

    monkeypatch.setattr(engines, "create_engine", create_engine)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)
    with pytest.raises(Started):
        _evaluate_model("m", "folder", 64, opts, {}, None, argparse.Namespace(batch_prompts=1), print, None)
    assert seen["kind"] == "vllm" and seen["gpu_memory_utilization"] == 0.85 and seen["enable_sleep_mode"] is False
