"""eval/warm_start_seeds.py end to end on a few supervised steps: it trains, evaluates with the trainer's
own held-out eval and reports each skill's loss (the script once broke silently when the trainer's
eval API changed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_warm_start_script_reports_scores_and_skill_losses(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "eval" / "warm_start_seeds.py"), "--arm", "smoke", "--seeds", "3",
           "--work", str(tmp_path / "work"), "--out", str(out), "sft.steps=3", "sft.batch_size=4",
           "data.synthetic_size=50", "eval.limit=4", "model.tiny_layers=1", "trainer.num_threads=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = json.loads((out / "results.json").read_text())["arms"]["smoke"]["seeds"]
    assert run["seed"] == 3 and len(run["loss"]) == 3
    assert set(run["accuracy"]) == {"16", "32", "48", "64"} and 0.0 <= run["anytime"] <= 1.0
    # the operand loss is also split by the trace line's step number (3-6 operands: steps 1-6)
    assert set(run["skills"]) == {"copy", "operand", "sum"} | {f"operand@{k}" for k in range(1, 7)}
    assert all(v > 0.5 for v in run["skills"].values())  # three SFT steps learn no skill: near a uniform guess
    assert "| operand |" in (out / "table.md").read_text() and (out / "sft_loss.png").is_file()
