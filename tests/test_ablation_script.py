"""eval/ablation.py: --extend-from resumes a longer sweep only from finished, shorter runs; scores are
cached per seed and protocol."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from anytime.config import load_recipe

REPO = Path(__file__).resolve().parents[1]


def load_ablation():
    spec = importlib.util.spec_from_file_location("ablation_script", REPO / "eval" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def finished_run(root: Path, step: int) -> Path:
    (root / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (root / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    (root / "final_eval.json").write_text("{}")
    (root / "ablation_seconds.txt").write_text("12.5\n")
    return root


@pytest.mark.unit
def test_extend_from_copies_a_shorter_run_without_its_final_eval(tmp_path):
    ablation = load_ablation()
    old = finished_run(tmp_path / "old", 80)
    assert ablation.continue_from(old, tmp_path / "new", steps=120) == 12.5
    assert (tmp_path / "new" / "checkpoints" / "step_80").is_dir()
    assert not (tmp_path / "new" / "final_eval.json").exists()  # the resumed run writes its own


@pytest.mark.unit
def test_extend_from_refuses_a_run_that_is_not_shorter_or_not_finished(tmp_path):
    ablation = load_ablation()
    old = finished_run(tmp_path / "old", 80)
    with pytest.raises(ValueError, match="not shorter than --steps 80"):
        ablation.continue_from(old, tmp_path / "new", steps=80)
    (old / "final_eval.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a finished run"):
        ablation.continue_from(old, tmp_path / "new", steps=120)
    assert not (tmp_path / "new").exists()


@pytest.mark.integration
def test_scores_are_cached_until_a_model_is_newer(tmp_path, monkeypatch):
    """`score` runs one `anytime eval` per seed and protocol, reuses its cache while no model is newer,
    and reads each model's accuracy from the eval's results.json."""
    import json
    import os

    ablation = load_ablation()
    models = {"warm start": tmp_path / "warm", "GRPO": tmp_path / "grpo" / "step_120"}
    for path in models.values():
        path.mkdir(parents=True)
    calls = []

    def fake_eval(cmd, check, env, stdout):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(exist_ok=True)
        paths = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--model"]
        (out / "results.json").write_text(json.dumps({"models": {
            p: {"synthetic": {"accuracy": [0.1 * k, 0.2, 0.3, 0.4]}} for k, p in enumerate(paths)}}))
        assert env["OMP_NUM_THREADS"] == "1" and "--temperature" in cmd and "0.6" in cmd

    monkeypatch.setattr(ablation.subprocess, "run", fake_eval)
    overrides = ["trainer.seed=3", "trainer.num_threads=1"]
    sampled = ablation.protocols(load_recipe(ablation.QUICKSTART, overrides))[0]
    sweep = ablation.Sweep(ablation.QUICKSTART, load_recipe(ablation.QUICKSTART, overrides).budget.grid())
    assert sampled.name == "sampled" and sampled.flags == ("--temperature", "0.6", "--top-p", "0.95", "--samples", "8")
    first = ablation.score(sweep, models, tmp_path, sampled, overrides)
    assert first == {"warm start": [0.0, 0.2, 0.3, 0.4], "GRPO": [0.1, 0.2, 0.3, 0.4]}
    assert "trainer:\n" in (tmp_path / "eval_recipe.yaml").read_text() and "seed: 3" in (tmp_path / "eval_recipe.yaml").read_text()
    assert ablation.score(sweep, models, tmp_path, sampled, overrides) == first and len(calls) == 1   # cached
    later = (tmp_path / "eval_sampled.json").stat().st_mtime + 10
    os.utime(models["GRPO"], (later, later))   # a retrained run: scored again
    assert ablation.score(sweep, models, tmp_path, sampled, overrides) == first and len(calls) == 2


@pytest.mark.unit
def test_the_ladder_follows_the_recipes_budget_grid():
    """Every rung trains on the sweep recipe's grid; GRPO is rewarded at its largest budget only. The
    quickstart's grid gives the committed ladder's overrides exactly."""
    ablation = load_ablation()
    recipe = str(REPO / "recipes" / "ablation" / "binding.yaml")
    binding = ablation.Sweep(recipe, load_recipe(recipe).budget.grid())
    assert binding.budgets == [12, 24, 36, 48]
    assert "budget.budgets=[48]" in binding.rungs["GRPO"]
    assert all("budget.budgets=[12,24,36,48]" in binding.rungs[name] for name in binding.rungs if name != "GRPO")
    assert ablation.Sweep(ablation.QUICKSTART, load_recipe(ablation.QUICKSTART).budget.grid()).rungs == ablation.LADDER
    committed = json.loads((REPO / "eval" / "ablation" / "results.json").read_text())["ladder"]
    assert committed == ablation.LADDER


@pytest.mark.unit
def test_only_a_finished_warm_start_is_shared(tmp_path, monkeypatch):
    """--warm-starts-from links a seed's finished warm start and leaves a seed it lacks to build its own."""
    ablation = load_ablation()
    import anytime.trainer.launch as launch

    built = tmp_path / "built"   # what the warm start would be, without training it
    built.mkdir()
    (built / "sft_loss.json").write_text('{"seconds": 1, "loss": []}')
    monkeypatch.setattr(launch, "prepare_model", lambda recipe: str(built))
    sweep = ablation.Sweep(ablation.QUICKSTART, [16, 32, 48, 64])
    (tmp_path / "other" / "seed0" / "warm_start" / "sft_model").mkdir(parents=True)
    (tmp_path / "other" / "seed0" / "warm_start" / "sft_model" / "sft_done.txt").touch()
    (tmp_path / "other" / "seed1" / "warm_start" / "sft_model").mkdir(parents=True)   # unfinished: no sft_done.txt
    for seed in (0, 1):
        ablation.run_seed(sweep, seed, 1, tmp_path / "work", [], [], [], warm_from=tmp_path / "other")
    assert (tmp_path / "work" / "seed0" / "warm_start").resolve() == (tmp_path / "other" / "seed0" / "warm_start")
    assert not (tmp_path / "work" / "seed1" / "warm_start").exists()


@pytest.mark.unit
def test_thinking_lengths_pair_each_rung_with_grpo_per_seed(tmp_path, monkeypatch):
    """eval/thinking_lengths.py reads the samples the ablation scored and names each model by its policy."""
    monkeypatch.syspath_prepend(str(REPO / "eval"))   # as when run as a script: it imports its sibling ablation.py
    spec = importlib.util.spec_from_file_location("thinking_lengths_script", REPO / "eval" / "thinking_lengths.py")
    lengths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths)
    per_seed = {}
    for seed, (grpo, linear) in enumerate([(40, 30), (44, 36)]):
        folder = tmp_path / f"seed{seed}"
        (folder / "eval_sampled").mkdir(parents=True)
        (folder / "eval_sampled.json").write_text(json.dumps({"models": {"GRPO": "a", "+linear": "b"}}))
        rows = [{"model": "a", "thinking_length": grpo, "natural_end": False},
                {"model": "b", "thinking_length": linear, "natural_end": True},
                {"model": "b", "thinking_length": linear + 2, "natural_end": False}]
        (folder / "eval_sampled" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        per_seed[seed] = lengths.seed_lengths(folder, "sampled")
    assert per_seed[0] == {"GRPO": (40.0, 0.0), "+linear": (31.0, 0.5)}
    stats = lengths.summarise(per_seed)
    assert stats["+linear"]["length_vs_grpo"][0] == pytest.approx(-8.0)   # (31-40 + 37-44) / 2
    assert stats["+linear"]["ended_vs_grpo"][0] == pytest.approx(0.5) and "length_vs_grpo" not in stats["GRPO"]
