from pathlib import Path

import pytest
import yaml

from anytime.cli import main
from anytime.config import Recipe, RecipeError, load_recipe, parse_override, recipe_from_dict

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if not p.name.startswith("_"))


def test_defaults_are_the_papers():
    r = Recipe()
    assert r.budget.grid() == [2000, 4000, 6000, 8000]
    assert r.rollout.n == 8 and r.summary.n == 4 and r.rollout.prompts_per_step == 64
    assert r.algorithm.decay == 0.5 and r.algorithm.clip_low == 0.2 and r.algorithm.loss_agg == "constant"
    assert r.learner.lr == 1e-6 and r.learner.grad_clip == 1.0 and r.learner.weight_decay == 0.01
    assert r.summary.header == "\n\n**Final Answer**\n"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_recipe_resolves(path, capsys):
    assert main(["config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "budgets:" in out
    assert yaml.safe_load(out.split("# budgets")[0])["model"]["path"]


def test_paper_recipes_set_the_five_knobs():
    grpo = load_recipe(REPO / "recipes/paper/grpo.yaml")
    assert (grpo.summary.n, grpo.summary.estimator, grpo.budget.grid(), grpo.budget.prior,
            grpo.algorithm.variance_reduction) == (1, "grpo", [8000], "base", "v2only")
    ar = load_recipe(REPO / "recipes/paper/ar_linear.yaml")
    assert ar.budget.prior_probs() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert (ar.summary.n, ar.algorithm.variance_reduction) == (4, "brpo")


def test_overrides():
    r = load_recipe(None, ["rollout.n=16", "budget.prior=uniform", "budget.budgets=[100, 200]", "eval.limit=null"])
    assert r.rollout.n == 16 and r.budget.prior_probs() == [0.5, 0.5] and r.eval.limit is None
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": 1}}}
    assert load_recipe(None, ["learner.lr=5e-4"]).learner.lr == 5e-4  # YAML 1.1 reads this as a string


def test_base_inheritance(tmp_path):
    (tmp_path / "parent.yaml").write_text("rollout: {n: 3, temperature: 0.7}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nrollout: {n: 5}\n")
    r = load_recipe(tmp_path / "child.yaml")
    assert (r.rollout.n, r.rollout.temperature) == (5, 0.7)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(RecipeError, match="loops"):
        load_recipe(tmp_path / "loop.yaml")


def test_cli_prints_errors_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {nn: 4}\n")
    assert main(["config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "did you mean `rollout.n`" in err and "Traceback" not in err
    assert main(["config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["config", str(RECIPES[0]), "rollout.n"]) == 2
    assert "key.path=value" in capsys.readouterr().err


@pytest.mark.parametrize(("serving", "cuda", "adapter"), [("auto", True, True), ("auto", False, False),
                                                          ("adapter", False, True), ("merged", True, False)])
def test_lora_vllm_serving_resolves_auto_by_device(serving, cuda, adapter):
    r = recipe_from_dict({"learner": {"lora": {"rank": 4, "vllm_serving": serving}}})
    assert r.learner.lora.vllm_serves_adapter(cuda) is adapter


def test_lora_vllm_serving_rejects_an_unknown_mode():
    with pytest.raises(RecipeError, match="vllm_serving"):
        recipe_from_dict({"learner": {"lora": {"rank": 4, "vllm_serving": "unmerged"}}})
