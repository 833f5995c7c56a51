"""Helpers shared by the trainer-level tests: the quickstart recipe, tiny-run overrides, metrics."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")


def tiny_overrides(out: Path, steps: int = 3) -> list[str]:
    return [f"trainer.output_dir={out}", f"model.path={out.parent / 'init'}", "model.tiny_hidden_size=64",
            "model.tiny_layers=1", "sft.steps=0", f"trainer.steps={steps}", "trainer.save_every=1",
            "rollout.prompts_per_step=2", "rollout.n=2", "summary.n=2", "budget.budgets=[8,16]",
            "budget.max_thinking=16", "eval.limit=4", "logging.progress=false", "trainer.num_threads=1",
            "learner.deterministic=true", "algorithm.entropy_coef=0.01", "logging.tensorboard=false"]


def read_metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows if "train/rows" in r}
