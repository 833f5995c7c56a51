"""`anytime eval` end to end on the CPU (tiny model, hf engine, the shipped benchmark fixtures):
samples.jsonl next to results.json, `--rescore` reproducing results.json, a training checkpoint as
`--model`, and `--recipe`."""

import json
import shutil

import pytest

from anytime.cli import main
from anytime.evaluation.records import read_samples, write_samples

pytestmark = pytest.mark.e2e

ANSWER = "</think>\n\n**Final Answer**\n\\boxed{{{}}}"
BUDGETS = [8, 16, 24]


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    """A learner checkpoint (step_3/ with model/ and the learner state) of the tiny model's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anytime.config import LearnerConfig
    from anytime.learner.checkpoint import save_checkpoint
    from anytime.learner.data_parallel import TorchLearner

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return str(save_checkpoint(tmp_path_factory.mktemp("ckpts"), 3, TorchLearner(model, LearnerConfig(), 10),
                               AutoTokenizer.from_pretrained(tiny_model_dir), {}, keep_last=1))


@pytest.fixture(scope="module")
def eval_out(tiny_model_dir, checkpoint, math_data_dir, tmp_path_factory):
    """One eval of two models (a model folder and a checkpoint) on two benchmarks, 3 problems × 2 samples."""
    out = tmp_path_factory.mktemp("eval") / "out"
    assert main(["eval", "--model", tiny_model_dir, "--model", checkpoint, "--benchmarks", "amc22,minerva",
                 "--data-dir", str(math_data_dir), "--limit", "3", "--budgets", "8:24:8", "--samples", "2",
                 "--temperature", "0.8", "--engine", "hf", "--summary-max-tokens", "6", "--max-prompt-len", "2000",
                 "--dtype", "float32", "--verifier-workers", "1", "--out", str(out)]) == 0
    return out


def test_samples_file_has_one_record_per_problem_and_sample(eval_out, tiny_model_dir, checkpoint, math_data_dir):
    results = json.loads((eval_out / "results.json").read_text())
    records = read_samples(eval_out / "samples.jsonl")
    assert len(records) == 2 * 2 * 3 * 2   # models × benchmarks × problems × samples
    for model in (tiny_model_dir, checkpoint):
        for bench, file in (("amc22", "test_amc.json"), ("minerva", "test_minerva.json")):
            rows = json.loads((math_data_dir / file).read_text())[:3]
            mine = [r for r in records if r["model"] == model and r["benchmark"] == bench]
            assert [(r["index"], r["sample"]) for r in mine] == [(i, g) for i in range(3) for g in range(2)]
            assert [r["problem"] for r in mine] == [row["problem"] for row in rows for _ in range(2)]
            assert [r["gold"] for r in mine] == [row["answer"] for row in rows for _ in range(2)]  # raw: float, list
            res = results["models"][model][bench]
            assert res["problems"] * res["samples"] == len(mine) == 6
            acc = [sum(r["budgets"][j]["summaries"][0]["score"] for r in mine) / 6 for j in range(3)]
            assert res["accuracy"] == pytest.approx(acc, abs=1e-12)
            assert res["avg_thinking_length"] == pytest.approx(sum(r["thinking_length"] for r in mine) / 6)
            assert sum(res["failures"].values()) == 6 * 3
            # the per-budget report, from the same records (`thinking_length` counts the ending token)
            done = [[r for r in mine if (r["natural_end"] or r["eos_end"]) and r["thinking_length"] <= b]
                    for b in BUDGETS]
            assert res["completed"] == pytest.approx([len(d) / 6 for d in done], abs=1e-12)
            assert res["cut"] == pytest.approx([1 - len(d) / 6 for d in done], abs=1e-12)
            for j, d in enumerate(done):
                scores = [r["budgets"][j]["summaries"][0]["score"] for r in d]
                assert res["completed_accuracy"][j] == (pytest.approx(sum(scores) / len(d)) if d else None)
            assert res["summary_length"] == pytest.approx(
                [sum(r["budgets"][j]["summaries"][0]["tokens"] for r in mine) / 6 for j in range(3)], abs=1e-12)
    for r in records:
        assert 0 < r["thinking_length"] <= BUDGETS[-1] + 1 and isinstance(r["natural_end"], bool)
        assert [e["budget"] for e in r["budgets"]] == BUDGETS
        for e in r["budgets"]:
            assert e["cut"] <= min(e["budget"], r["thinking_length"])
            [s] = e["summaries"]
            assert s["text"].count("</think>") == 1 and s["reason"] in ("correct", "wrong", "no_answer", "bad_format")
            assert 1 <= s["tokens"] <= 6   # --summary-max-tokens
    assert isinstance(records[0]["gold"], float) and isinstance(records[6]["gold"], list)
    table = (eval_out / "results.md").read_text()
    assert "acc@16" in table and "AUC" in table and "| completed | completed acc | cut | summary len |" in table


def test_a_checkpoint_is_exported_on_the_fly_and_scores_as_its_weights(eval_out, tiny_model_dir, checkpoint):
    records = read_samples(eval_out / "samples.jsonl")
    plain = [{k: v for k, v in r.items() if k != "model"} for r in records if r["model"] == tiny_model_dir]
    ckpt = [{k: v for k, v in r.items() if k != "model"} for r in records if r["model"] == checkpoint]
    assert plain == ckpt   # same weights, same seeds: the same samples
    assert sorted(p.name for p in eval_out.iterdir()) == ["accuracy_vs_budget.png", "results.csv", "results.json",
                                                         "results.md", "samples.jsonl"]  # temporary export removed


def test_rescore_reproduces_results_and_re_verifies(eval_out, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(eval_out, out)
    before = {name: (out / name).read_bytes() for name in ("results.json", "samples.jsonl", "results.csv")}
    assert main(["eval", "--rescore", str(out), "--verifier-workers", "1"]) == 0
    assert {name: (out / name).read_bytes() for name in before} == before

    # Write a correct answer into sample 0 of every AMC problem at budgets 16 and 24 (AMC golds are
    # floats: 22.0 is answered 22), as a verifier fix would turn verdicts: the aggregates follow.
    # A cut at or past an EOS ending stays 0 whatever its text (forced_zero).
    records = read_samples(out / "samples.jsonl")
    fixed = [0, 0, 0]   # rewritten summaries per budget
    for r in records:
        if r["model"] == checkpoint and r["benchmark"] == "amc22" and r["sample"] == 0:
            for j, e in enumerate(r["budgets"][1:], start=1):
                e["summaries"][0]["text"] = ANSWER.format(int(r["gold"]))
                fixed[j] += not e["forced_zero"]
    assert fixed[1] == 3  # budget 16 is below every trace's end here
    write_samples(records, out / "samples.jsonl")
    assert main(["eval", "--rescore", str(out), "--verifier-workers", "1"]) == 0
    assert "verdicts changed" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    amc = results["models"][checkpoint]["amc22"]
    assert amc["accuracy"] == [0.0, 0.5, fixed[2] / 6]
    assert amc["failures"]["correct"] == fixed[1] + fixed[2]
    original = json.loads(before["results.json"])
    assert amc["seconds"] == original["models"][checkpoint]["amc22"]["seconds"]  # generation facts kept
    for model, per_bench in original["models"].items():
        for bench, res in per_bench.items():
            if (model, bench) != (checkpoint, "amc22"):
                assert results["models"][model][bench] == res
    assert sum(s["score"] for r in read_samples(out / "samples.jsonl") for e in r["budgets"] for s in e["summaries"]) \
        == fixed[1] + fixed[2]


def test_rescore_refuses_what_it_cannot_reproduce(eval_out, tmp_path, capsys):
    assert main(["eval", "--rescore", str(tmp_path)]) == 2
    assert "results.json" in capsys.readouterr().err
    out = tmp_path / "out"
    shutil.copytree(eval_out, out)
    records = read_samples(out / "samples.jsonl")
    write_samples([r for r in records if r["benchmark"] != "minerva"], out / "samples.jsonl")
    assert main(["eval", "--rescore", str(out)]) == 2
    assert "rescoring needs every sample of every benchmark" in capsys.readouterr().err
    assert main(["eval", "--rescore", str(out), "--model", "m"]) == 2
    assert "drop --model" in capsys.readouterr().err
    assert main(["eval", "--model", "m"]) == 2
    assert "--out DIR" in capsys.readouterr().err


def test_recipe_sets_the_eval_like_the_trainer(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["eval", "--recipe", "recipes/quickstart.yaml", "--model", tiny_model_dir, "--limit", "2",
                 "--verifier-workers", "1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["budgets"] == [16, 32, 48, 64] and list(results["models"][tiny_model_dir]) == ["synthetic"]
    settings = results["settings"]
    assert (settings["recipe"], settings["engine"], settings["summary_max_tokens"], settings["temperature"]) == \
        ("recipes/quickstart.yaml", "hf", 8, 0.6)
    assert (results["seed"], results["sample_seed"]) == (0, 12345)   # trainer.seed, eval.seed
    assert len(read_samples(out / "samples.jsonl")) == 2 * 8   # problems × eval.samples
    assert "acc@64" in capsys.readouterr().out
