"""The DeepSpeed learner, launched by `anytime train` itself in 2 processes (gloo on the CPU)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_process_deepspeed_training_and_export(tmp_path, zero_stage):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=2),
           "learner.backend=deepspeed", "learner.num_processes=2", f"learner.zero_stage={zero_stage}",
           "learner.deterministic=false", "rollout.prompts_per_step=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    assert all(m["update/grad_norm"] > 0 and m["update/skipped_updates"] == 0 for m in metrics.values())
    step = out / "checkpoints" / "step_2"
    assert (step / "deepspeed").is_dir() and (step / "model" / "model.safetensors").is_file()
    # The exported folder reproduces the DeepSpeed learner's (consolidated ZeRO) weights.
    from anytime.serving.export import export_checkpoint, learner_state_dict

    exported, diff = export_checkpoint(step, tmp_path / "hf")
    assert diff <= 1e-5
    from safetensors.torch import load_file

    saved = load_file(str(exported / "model.safetensors"))
    consolidated = learner_state_dict(step)
    assert all(torch.allclose(consolidated[k].float(), saved[k].float(), atol=0) for k in consolidated)
