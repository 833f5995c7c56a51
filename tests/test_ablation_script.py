"""eval/ablation.py's --extend-from: a longer sweep resumes only from finished, shorter runs."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_ablation():
    spec = importlib.util.spec_from_file_location("ablation_script", REPO / "eval" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finished_run(root: Path, step: int) -> Path:
    (root / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (root / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    (root / "final_eval.json").write_text("{}")
    (root / "ablation_seconds.txt").write_text("12.5\n")
    return root


def test_extend_from_copies_a_shorter_run_without_its_final_eval(tmp_path):
    ablation = load_ablation()
    old = finished_run(tmp_path / "old", 80)
    assert ablation.continue_from(old, tmp_path / "new", steps=120) == 12.5
    assert (tmp_path / "new" / "checkpoints" / "step_80").is_dir()
    assert not (tmp_path / "new" / "final_eval.json").exists()  # the resumed run writes its own


def test_extend_from_refuses_a_run_that_is_not_shorter_or_not_finished(tmp_path):
    ablation = load_ablation()
    old = finished_run(tmp_path / "old", 80)
    with pytest.raises(ValueError, match="not shorter than --steps 80"):
        ablation.continue_from(old, tmp_path / "new", steps=80)
    (old / "final_eval.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a finished run"):
        ablation.continue_from(old, tmp_path / "new", steps=120)
    assert not (tmp_path / "new").exists()
