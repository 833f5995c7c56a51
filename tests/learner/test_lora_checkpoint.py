"""LoRA through the trainer: checkpoints hold only the adapter and its optimizer state, a resumed run
takes exactly the steps of an uninterrupted one, and `anytime export` writes a merged folder (default)
and the PEFT adapter folder (`--adapter`) that load in transformers with the learner's log-probs and
greedy tokens."""

from __future__ import annotations

import pytest
import torch

from anytime.learner import checkpoint as ckpt
from anytime.trainer.launch import launch_train
from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

pytest.importorskip("peft")

LORA = ["learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=1e-2", "learner.lora.dropout=0.1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runs")
    full, part = root / "full" / "run", root / "part" / "run"
    assert launch_train(QUICKSTART, tiny_overrides(full, steps=3) + LORA) == 0
    assert launch_train(QUICKSTART, tiny_overrides(part, steps=2) + LORA) == 0
    assert launch_train(QUICKSTART, tiny_overrides(part, steps=3) + LORA) == 0   # resume: auto from step_2
    return full, part


@pytest.mark.e2e
def test_checkpoint_holds_only_the_adapter_and_resume_is_exact(runs):
    full, part = runs
    a, b = read_metrics(full), read_metrics(part)
    assert a[3] == b[3]
    assert a[3]["update/grad_norm"] > 0 and a[3]["update/skipped_updates"] == 0
    step = part / "checkpoints" / "step_3"
    assert not (step / "model").exists()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (step / "adapter").iterdir()}
    state = ckpt.load_tensors(step / "optimizer.pt")["optimizer"]["state"]
    from safetensors.torch import load_file

    adapter = load_file(step / "adapter" / "adapter_model.safetensors")
    assert len(state) == len(adapter) and all("lora_" in k for k in adapter)
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(t.numel() for t in adapter.values())


@pytest.mark.e2e
def test_export_merged_and_adapter_match_the_learner(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from anytime.cli import main
    from anytime.serving.export import export_checkpoint, load_adapter_model

    step = runs[0] / "checkpoints" / "step_3"
    merged, diff_merged = export_checkpoint(step, tmp_path / "merged")
    adapter, diff_adapter = export_checkpoint(step, tmp_path / "adapter", adapter=True)
    assert diff_merged <= 1e-5 and diff_adapter <= 1e-6
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    assert (merged / "model.safetensors").is_file()
    # the learner: the base model with the checkpoint's adapter, unmerged
    learner, tokenizer = load_adapter_model(step / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    peft_reloaded, _ = load_adapter_model(adapter)
    prompt = tokenizer("Start with 3. Add 4, add 5.", return_tensors="pt")["input_ids"]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    want = learner.generate(prompt, **kwargs)
    assert torch.equal(plain.generate(prompt, **kwargs), want)
    assert torch.equal(peft_reloaded.generate(prompt, **kwargs), want)
    assert main(["export", str(step), "--out", str(tmp_path / "cli"), "--adapter"]) == 0
    # a full fine-tuning checkpoint has no adapter to export
    with pytest.raises(ValueError, match="--adapter needs a LoRA checkpoint"):
        export_checkpoint(merged, tmp_path / "none", adapter=True)


@pytest.mark.e2e
def test_eval_takes_a_lora_checkpoint_and_its_adapter_folder(runs, tmp_path, math_data_dir):
    """`anytime eval --model step_N` on a LoRA checkpoint (and on an exported adapter folder) scores what
    its merged export scores: same greedy traces, same accuracies."""
    import json

    from anytime.cli import main
    from anytime.serving.export import export_checkpoint

    step = runs[0] / "checkpoints" / "step_3"
    merged, _ = export_checkpoint(step, tmp_path / "merged")
    adapter, _ = export_checkpoint(step, tmp_path / "adapter", adapter=True)
    out = tmp_path / "eval"
    models = [str(step), str(adapter), str(merged)]
    assert main(["eval", *[a for m in models for a in ("--model", m)], "--benchmarks", "amc22",
                 "--data-dir", str(math_data_dir), "--limit", "2", "--budgets", "8:16:8", "--temperature", "0",
                 "--engine", "hf", "--summary-max-tokens", "6", "--max-prompt-len", "2000", "--dtype", "float32",
                 "--verifier-workers", "1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["models"]
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    traces = {m: [r["budgets"] for r in records if r["model"] == m] for m in models}
    assert traces[str(step)] == traces[str(merged)] == traces[str(adapter)] and traces[str(step)]
    assert results[str(step)]["amc22"]["accuracy"] == results[str(merged)]["amc22"]["accuracy"]
