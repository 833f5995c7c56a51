"""One dispatcher of sources (`anytime.data.sources.source_kind`), for training rows and benchmarks alike."""

import json
import random

import pytest

from anytime.config import load_recipe
from anytime.data.benchmarks import REGISTRY_ENV, load_benchmark
from anytime.data.prompts import SYNTHETIC_EVAL_SEED, SYNTHETIC_TRAIN_SEED, DataError, PromptRow, synthetic_rows
from anytime.data.sources import DATASET, SYNTHETIC, TASK, load_train_rows, source_kind

pytestmark = pytest.mark.unit


def test_a_source_is_the_synthetic_task_a_procedural_task_or_rows_to_read():
    assert source_kind("synthetic") == SYNTHETIC
    assert source_kind("reasoning_gym:chain_sum") == TASK
    for source in ("agentica-org/DeepScaleR-Preview-Dataset", "Hothan/OlympiadBench:OE_TO_maths_en_COMP",
                   "rows.jsonl", "./data/rows.json", "aime24", "Synthetic", "reasoning_gym"):
        assert source_kind(source) == DATASET, source


def test_training_and_eval_take_the_synthetic_task_from_their_own_seeds():
    recipe = load_recipe(None, ["data.train=synthetic", "data.synthetic_size=40", "trainer.seed=3", "data.limit=30"])
    expected = synthetic_rows(40, SYNTHETIC_TRAIN_SEED + 3, 3, 6)
    random.Random(3).shuffle(expected)
    assert load_train_rows(recipe) == expected[:30]
    assert load_benchmark("synthetic", limit=30, seed=3) == synthetic_rows(30, SYNTHETIC_EVAL_SEED + 3, 3, 6)


def test_a_file_is_read_shuffled_by_the_seed_unless_told_not_to(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"what is {i}?", "answer": str(i)}) for i in range(20)))
    rows = [PromptRow(str(i), f"what is {i}?", str(i)) for i in range(20)]
    shuffled = list(rows)
    random.Random(5).shuffle(shuffled)
    assert load_train_rows(load_recipe(None, [f"data.train={path}", "trainer.seed=5", "data.limit=7"])) == shuffled[:7]
    assert load_train_rows(load_recipe(None, [f"data.train={path}", "data.shuffle=false"])) == rows


def test_only_a_registered_benchmark_needs_the_registry(tmp_path, monkeypatch):
    """The dispatcher decides before the registry is read: the built-in sources load without it."""
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "missing.yaml"))
    assert len(load_benchmark("synthetic", limit=5)) == 5
    with pytest.raises(DataError, match="benchmark registry .*missing.yaml.* not found"):
        load_benchmark("aime24")
