"""Per-sample eval records without a model: aggregation, the size cap, re-verification with the real
verifier, the results table's budgets, and eval settings taken from a training recipe."""

import argparse
import json
from functools import partial

import pytest

from anytime.data.benchmarks import task_split
from anytime.errors import RecipeError
from anytime.evaluation.evaluate import table_budgets
from anytime.evaluation.options import EvalOptions, add_option_arguments, recipe_options, resolve_options
from anytime.evaluation.records import aggregate, cap_records, read_samples, rescore_records, write_samples


ANSWER = "</think>\n\n**Final Answer**\n\\boxed{{{}}}"


def _record(index, sample, scores, *, benchmark="b", gold="7", length=30, reasons=None):
    """A record whose budgets 10/20/30 hold one summary each with the given scores."""
    reasons = reasons or ["correct" if s else "wrong" for s in scores]
    return {"benchmark": benchmark, "index": index, "problem_id": f"p{index}", "problem": "?", "gold": gold,
            "sample": sample, "thinking_length": length, "natural_end": True, "eos_end": False,
            "budgets": [{"budget": b, "cut": b, "forced_zero": False,
                         "summaries": [{"text": ANSWER.format(gold if s else "0"), "answer": gold if s else "0",
                                        "score": float(s), "reason": r}]}
                        for b, s, r in zip((10, 20, 30), scores, reasons)]}


@pytest.mark.unit
def test_aggregate_counts_every_sample_and_problem():
    records = [_record(0, 0, [0, 1, 1]), _record(0, 1, [0, 0, 0], length=10),
               _record(1, 0, [1, 1, 1], length=20), _record(1, 1, [0, 0, 1], length=40, reasons=["no_answer"] * 2 + ["correct"])]
    r = aggregate(records, [10, 20, 30])
    assert r["problems"] == 2 and r["samples"] == 2
    assert r["accuracy"] == [0.25, 0.5, 0.75]
    assert r["final_accuracy"] == 0.75 and r["anytime_accuracy"] == pytest.approx(0.5)
    assert r["area_under_curve"] == pytest.approx((0.25 + 0.5 + 0.75) / 3)
    assert r["avg_thinking_length"] == 25.0
    # problem 0: 1 of 2 samples right at the last budget, problem 1: 2 of 2
    assert r["pass@1"] == pytest.approx((0.5 + 1.0) / 2) and r["pass@2"] == 1.0
    assert r["failures"] == {"correct": 6, "no_answer": 2, "wrong": 4}
    assert aggregate(records, [10, 20, 30], probs=[0.0, 0.0, 1.0])["anytime_accuracy"] == 0.75
    with pytest.raises(ValueError, match=r"has budgets \[10, 20, 30\], expected \[10, 20\]"):
        aggregate(records, [10, 20])
    with pytest.raises(ValueError, match="no sample records"):
        aggregate([], [10])


@pytest.mark.unit
def test_samples_file_cap_shares_fairly_between_benchmarks(tmp_path):
    small = [_record(i, 0, [1, 1, 1], benchmark="small") for i in range(3)]
    big = [_record(i, 0, [0, 0, 0], benchmark="big") for i in range(20)]
    other = [_record(i, 0, [0, 0, 1], benchmark="other") for i in range(20)]
    records = big[:10] + small + other + big[10:]
    kept = cap_records(records, 13)
    by_bench = {b: [r["index"] for r in kept if r["benchmark"] == b] for b in ("small", "big", "other")}
    assert by_bench == {"small": [0, 1, 2], "big": list(range(5)), "other": list(range(5))}
    assert kept == [r for r in records if r in kept]  # file order kept
    path = tmp_path / "eval" / "step_3.jsonl"
    assert write_samples(records, path, max_records=13) == 13
    assert read_samples(path) == kept
    assert write_samples(records, path, max_records=None) == len(records) and read_samples(path) == records
    assert write_samples(records, tmp_path / "none.jsonl", max_records=0) == 0
    assert not (tmp_path / "none.jsonl").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    (tmp_path / "bad.jsonl").write_text(json.dumps(records[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON record"):
        read_samples(tmp_path / "bad.jsonl")


@pytest.mark.integration
def test_rescore_re_verifies_texts_and_keeps_forced_zeros():
    from anytime.reward.verifier import RewardScorer

    right = _record(0, 0, [0, 1, 1], gold="\\frac{1}{2}")
    # a stale verdict (as from a verifier bug): 0.5 recorded as wrong for the gold 1/2; rescoring corrects it
    right["budgets"][0]["summaries"][0].update(text=ANSWER.format("0.5"), answer="0.5", score=0.0, reason="wrong")
    forced = _record(1, 0, [1, 1, 1], gold="3")
    for entry in forced["budgets"][1:]:   # EOS inside the thinking: these cuts score 0 whatever the text says
        entry["forced_zero"] = True
        entry["summaries"][0].update(score=0.0, reason="bad_format")
    with RewardScorer(num_workers=1) as scorer:
        (new_right, new_forced), changed = rescore_records([right, forced], scorer)
    assert [e["summaries"][0]["score"] for e in new_right["budgets"]] == [1.0, 1.0, 1.0]
    assert new_right["budgets"][0]["summaries"][0]["reason"] == "correct"
    assert [(e["summaries"][0]["score"], e["summaries"][0]["reason"]) for e in new_forced["budgets"]] == \
        [(1.0, "correct"), (0.0, "bad_format"), (0.0, "bad_format")]
    assert changed == 1
    assert right["budgets"][0]["summaries"][0]["score"] == 0.0  # the input records are left alone


@pytest.mark.unit
def test_table_shows_a_few_budgets():
    assert table_budgets([8, 16, 24, 32]) == [8, 16, 24, 32]
    assert table_budgets(list(range(250, 8001, 250))) == [2000, 4000, 6000, 8000]
    assert table_budgets([100, 200, 4000, 8000, 16000]) == [4000, 8000, 16000]


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_option_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.unit
def test_recipe_supplies_the_in_training_eval_settings(tmp_path):
    from anytime.config import load_recipe

    opts = resolve_options(_args("--recipe", "recipes/quickstart.yaml"))
    assert opts.budgets == (16, 32, 48, 64) and opts.benchmarks == ("synthetic",)
    assert (opts.samples, opts.summaries, opts.summary_max_tokens, opts.temperature, opts.top_p, opts.limit) == \
        (8, 1, 8, 0.6, 0.95, 200)
    assert (opts.engine, opts.dtype, opts.max_prompt_len) == ("hf", "float32", 128)
    assert (opts.seed, opts.sample_seed) == (0, 12345)   # trainer.seed picks the problems, eval.seed samples
    settings = opts.settings(seed=3)
    assert settings.summary_temperature == 0.6 and settings.summaries_per_budget == 1 and settings.seed == 3
    # explicit flags win over the recipe
    opts = resolve_options(_args("--recipe", "recipes/quickstart.yaml", "--budgets", "8:24:8", "--temperature", "0.5",
                                 "--benchmarks", "math500, amc22", "--header", "\nAnswer:", "--seed", "4"))
    assert opts.budgets == (8, 16, 24) and opts.temperature == 0.5 and opts.benchmarks == ("math500", "amc22")
    assert (opts.seed, opts.sample_seed) == (4, 12345)
    assert opts.header == "\nAnswer:" and opts.settings(0).summary_temperature == 0.5
    # eval.budgets, when set, is used instead of the training grid; summary.* and data.* carry over
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval: {budgets: [100, 200], benchmarks: [aime24], samples: 4, temperature: 0.7}\n"
                      "summary: {max_tokens: 50, header: \"\\nANSWER\\n\", think_end: '</reasoning>', close_text: ' </reasoning>', n: 3}\n"
                      "data: {instruction: Solve it.}\n")
    opts = resolve_options(_args("--recipe", str(recipe)))
    assert (opts.budgets, opts.benchmarks, opts.samples) == ((100, 200), ("aime24",), 4)
    assert (opts.summary_max_tokens, opts.header, opts.think_end, opts.instruction) == (50, "\nANSWER\n", "</reasoning>", "Solve it.")
    assert opts.summaries == 1  # the in-training eval samples one summary per budget, not summary.n
    assert recipe_options(load_recipe(None))["budgets"] == (2000, 4000, 6000, 8000)
    assert resolve_options(_args()) == EvalOptions()
    # one message for a recipe and a flag (`AnswerFormat`): the close text must end with the end marker
    with pytest.raises(RecipeError, match="`summary.close_text` .* must end with `summary.think_end` '</reasoning>'"):
        resolve_options(_args("--think-end", "</reasoning>"))
    with pytest.raises(RecipeError, match=r"`summary.close_text` '</think>\\n\\n' must end with"):
        resolve_options(_args("--close-text", "</think>\n\n"))


@pytest.mark.unit
def test_a_recipes_procedural_task_keeps_its_knobs_and_training_split_in_eval(tmp_path):
    """`anytime eval --recipe` scores `reasoning_gym:<task>` on the held-out split the run's own eval
    uses: the recipe's task knobs, disjoint from its training split; other benchmarks get neither."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {train: 'reasoning_gym:chain_sum', task_size: 64,\n"
                      "       task_config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}\n"
                      "eval: {benchmarks: ['reasoning_gym:chain_sum', math500]}\n")
    opts = resolve_options(_args("--recipe", str(recipe)))
    split = partial(task_split, train_source=opts.train_task, task_config=dict(opts.task_config),
                    task_size=opts.task_size)
    assert split("reasoning_gym:chain_sum") == {
        "task_config": {"max_digits": 1, "max_terms": 2, "min_digits": 1, "min_terms": 2}, "train_size": 64}
    assert split("math500") == {"task_config": None, "train_size": 0}
    # without a recipe (or for a task the run did not train on) there is no training split to avoid,
    # exactly as the in-training eval treats a benchmark that is not `data.train`
    plain = EvalOptions()
    assert task_split("reasoning_gym:chain_sum", plain.train_task, dict(plain.task_config), plain.task_size) == {
        "task_config": None, "train_size": 0}
