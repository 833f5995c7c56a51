"""The pipelined learner inside the RL trainer (`learner.pipeline.stages > 1`).

The decisive check: one RL update (log-probs of the rollout, then PPO mini-batch steps) on 2
pipeline ranks leaves exactly the weights (fp64, <= 1e-10) and statistics of the torch learner
on one process, through the same `ppo_update`; plus a checkpoint round trip of every stage's optimizer state, the
recipe checks, and `anytime train` end to end with a 2-stage learner.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from anytime.batch.train_batch import TrainBatch
from anytime.config import AlgorithmConfig, LearnerConfig, PipelineConfig
from tests.batch.test_packing import assert_same_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOL = 1e-10
VOCAB, PAD = 61, 0
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")

# Each case: schedule, microbatches, model (tied or not), loss aggregation, clipping, LR schedule.
CASES = [
    {"id": "zb-h1", "schedule": "zb-h1", "m": 4, "tied": False, "agg": "constant", "grad_clip": 1.0,
     "epochs": 1, "entropy_coef": 0.01, "lr_schedule": "cosine", "warmup": 1},
    {"id": "1f1b-tied-clipped", "schedule": "1f1b", "m": 2, "tied": True, "agg": "token-mean", "grad_clip": 1e-3,
     "epochs": 2, "entropy_coef": 0.0, "lr_schedule": "constant", "warmup": 0},
    {"id": "zb-v-seq-mean", "schedule": "zb-v", "m": 2, "tied": False, "agg": "seq-mean-token-mean",
     "grad_clip": 0.0, "epochs": 1, "entropy_coef": 0.01, "lr_schedule": "linear", "warmup": 0},
]


def _model_dir(root: Path, tied: bool) -> str:
    import transformers

    path = root / ("tied" if tied else "untied")
    if not path.is_dir():
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                          max_position_embeddings=64, tie_word_embeddings=tied)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(path)
    return str(path)


def _train_batch(seed: int = 0) -> TrainBatch:
    """5 prompts x 3 rows (2 thinking, 1 summary), varied lengths; prompt 4's rows were all dropped
    (zero advantage), so its mini-batch is empty; tokens per prompt counted before dropping."""
    rng = random.Random(seed)
    rows, tokens = [], [0] * 5
    for p in range(5):
        n_prompt = rng.randint(2, 4)
        for kind in ("thinking", "thinking", "summary"):
            n = rng.randint(3, 11)
            tokens[p] += n
            if p == 4:
                continue
            rows.append((p, kind, [rng.randrange(1, VOCAB) for _ in range(n_prompt + n)], n,
                         [rng.gauss(0, 1) for _ in range(n)], [-3 * rng.random() for _ in range(n)]))
    R, T = len(rows), max(len(r[2]) for r in rows)
    ids = torch.full((R, T), PAD, dtype=torch.long)
    think, summ = torch.zeros(R, T - 1, dtype=torch.bool), torch.zeros(R, T - 1, dtype=torch.bool)
    adv, roll = torch.zeros(R, T - 1), torch.zeros(R, T - 1)
    for i, (_, kind, seq, n, a, lp) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        first = len(seq) - n - 1  # target-aligned: column t scores token t + 1
        (think if kind == "thinking" else summ)[i, first: first + n] = True
        adv[i, first: first + n] = torch.tensor(a)
        roll[i, first: first + n] = torch.tensor(lp)
    return TrainBatch(ids, torch.tensor([len(r[2]) for r in rows]), torch.tensor([r[0] for r in rows]), think, summ,
                      torch.zeros_like(think), adv, roll, torch.zeros(R, T - 1), torch.tensor(tokens),
                      traces_per_prompt=2, max_len=16, pad_id=PAD)


def _configs(case: dict) -> tuple[AlgorithmConfig, LearnerConfig]:
    algo = AlgorithmConfig(loss_agg=case["agg"], entropy_coef=case["entropy_coef"], clip_low=0.2, clip_high=0.28)
    cfg = LearnerConfig(lr=1e-2, weight_decay=0.1, grad_clip=case["grad_clip"], ppo_epochs=case["epochs"],
                        mini_batch_prompts=2, micro_batch_tokens=10**6, lr_schedule=case["lr_schedule"],
                        warmup_steps=case["warmup"],
                        pipeline=PipelineConfig(stages=2, schedule=case["schedule"], microbatches=case["m"]))
    return algo, cfg


def _reference(model_dir: str, case: dict, dtype: torch.dtype = torch.float64, configs=None) -> dict:
    """The unpipelined RL update on one process: TorchLearner log-probs, then the PPO loop
    (`configs(case)` gives the (AlgorithmConfig, LearnerConfig) of a case)."""
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import TorchLearner
    from anytime.learner.ppo import ppo_update

    algo, cfg = (configs or _configs)(case)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    learner = TorchLearner(model, cfg, total_steps=10)
    batch = _train_batch()
    batch.old_logprobs = learner.logprobs(batch)
    stats = ppo_update(learner, batch, algo, cfg)
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "stats": stats,
            "old_logprobs": batch.old_logprobs}


def _worker(rank: int, world: int, init_file: str, out_dir: str, dirs: dict) -> None:
    from anytime.learner.pipeline_learner import PipelineLearner
    from anytime.learner.ppo import ppo_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case in CASES:
            algo, cfg = _configs(case)
            model_dir = dirs["tied" if case["tied"] else "untied"]
            learner = PipelineLearner(model_dir, cfg, total_steps=10, dtype=torch.float64)
            batch = _train_batch()
            batch.old_logprobs = learner.logprobs(batch)
            stats = ppo_update(learner, batch, algo, cfg)
            torch.save({"weights": learner.model.full_state_dict(dst=None), "stats": stats,
                        "old_logprobs": batch.old_logprobs,
                        "held": sorted(n for n, _ in learner.model.named_parameters())},
                       os.path.join(out_dir, f"{case['id']}.rank{rank}.pt"))
            if case is CASES[0]:
                _checkpoint_round_trip(rank, out_dir, model_dir, learner, batch, algo, cfg)
    finally:
        dist.destroy_process_group()


def _checkpoint_round_trip(rank, out_dir, model_dir, learner, batch, algo, cfg) -> None:
    """Save (each rank writes its stages' optimizer state), resume into a fresh learner, take one
    more update on both: the resumed one must land on the same weights."""
    from anytime.learner import checkpoint as ckpt
    from anytime.learner.pipeline_learner import PipelineLearner
    from anytime.learner.ppo import ppo_update

    path = ckpt.save_checkpoint(Path(out_dir) / "checkpoints", 1, learner, None, {"data_position": 1},
                                keep_last=2, generation_source=model_dir)
    fresh = PipelineLearner(model_dir, cfg, total_steps=10, dtype=torch.float64)
    state = ckpt.load_checkpoint(path, fresh)
    loaded = _max_diff(fresh.model.state_dict(), learner.model.state_dict())
    for lrn in (learner, fresh):
        batch.old_logprobs = lrn.logprobs(batch)
        ppo_update(lrn, batch, algo, cfg)
    after = _max_diff(fresh.model.state_dict(), learner.model.state_dict())
    with open(os.path.join(out_dir, f"resume.rank{rank}.json"), "w") as f:
        json.dump({"step": state["step"], "loaded_err": loaded, "after_err": after,
                   "lr": [fresh.optimizer.param_groups[0]["lr"], learner.optimizer.param_groups[0]["lr"]]}, f)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_pipelined_rl_update_equals_the_unpipelined_one(tmp_path):
    dirs = {"tied": _model_dir(tmp_path, True), "untied": _model_dir(tmp_path, False)}
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path), dirs), nprocs=2)
    refs = {}
    for case in CASES:
        refs[case["id"]] = ref = _reference(dirs["tied" if case["tied"] else "untied"], case)
        runs = [torch.load(tmp_path / f"{case['id']}.rank{r}.pt") for r in range(2)]
        start = _reference_start(dirs["tied" if case["tied"] else "untied"])
        assert _max_diff(ref["weights"], start) > 1e-4, "test setup: the update must move the weights"
        for r, run in enumerate(runs):
            where = f"{case['id']} rank {r}"
            assert _max_diff(run["weights"], ref["weights"]) <= TOL, where
            lp_err = float((run["old_logprobs"] - ref["old_logprobs"]).abs().max())
            assert lp_err <= TOL, f"{where}: old logprobs differ by {lp_err}"
            assert set(run["stats"]) == set(ref["stats"]), where
            for k, v in ref["stats"].items():
                assert abs(run["stats"][k] - v) <= TOL * max(1.0, abs(v)), f"{where}: {k} {run['stats'][k]} vs {v}"
        # The two ranks hold disjoint stages that together make the whole model.
        held = [set(run["held"]) for run in runs]
        assert not held[0] & held[1]
        assert held[0] | held[1] | {"lm_head.weight"} == set(ref["weights"]) | {"lm_head.weight"}
    assert refs["1f1b-tied-clipped"]["stats"]["grad_norm"] > 1e-2  # every step of that case really clipped
    resume = [json.loads((tmp_path / f"resume.rank{r}.json").read_text()) for r in range(2)]
    for r in resume:
        assert r["step"] == 1 and r["loaded_err"] == 0.0
        assert r["after_err"] <= TOL and r["lr"][0] == r["lr"][1]


# Tree-packed rows through the pipeline: (schedule, microbatches, loss aggregation).
PACKED_CASES = [("zb-h1", 4, "seq-mean-token-mean"), ("1f1b", 2, "constant"), ("zb-v", 2, "token-mean")]


def _packed_worker(rank: int, world: int, init_file: str, out_dir: str, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from anytime.learner.pipeline_learner import PipelineLearner
    from tests.batch.test_packing import exact_norms, one_step, step_configs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for schedule, m, agg in PACKED_CASES:
            batch = TrainBatch.from_tensors(torch.load(os.path.join(out_dir, "packed.pt")))
            algo, cfg = step_configs(agg, 1e-2, pipeline=PipelineConfig(stages=2, schedule=schedule, microbatches=m))
            model = exact_norms(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64))
            learner = PipelineLearner(model, cfg, total_steps=1, dtype=torch.float64)
            result = one_step(learner, learner.model.named_parameters, batch, algo)
            torch.save(result, os.path.join(out_dir, f"packed-{schedule}.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_pipelined_packed_step_equals_the_row_per_summary_step(tiny_model_dir, tmp_path):
    """Tree-packed rows of a real rollout on 2 pipeline ranks: the old log-probs, loss, every
    gradient and the updated weights of one step equal the torch learner's on the row-per-summary
    layout (fp64, exact norms, <= 1e-10)."""
    from tests.batch.test_packing import layouts, real_rollout, stopping_model, torch_step

    model_dir = stopping_model(tiny_model_dir, tmp_path / "model")
    rows, packed = layouts(real_rollout(model_dir))
    assert packed.packed and len(packed) < len(rows)
    torch.save(packed.to_tensors(), tmp_path / "packed.pt")
    mp.spawn(_packed_worker, args=(2, str(tmp_path / "store"), str(tmp_path), model_dir), nprocs=2)
    for schedule, _, agg in PACKED_CASES:
        ref = torch_step(model_dir, rows, torch.float64, agg, 1e-2)
        runs = [torch.load(tmp_path / f"packed-{schedule}.rank{r}.pt") for r in range(2)]
        for run in runs:
            assert_same_step(ref, run, TOL, sums=run["sums"]["tokens"] > 0)
        assert sorted(set(runs[0]["grads"]) | set(runs[1]["grads"])) == sorted(ref["grads"])


def _reference_start(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.unit
def test_mini_batches_group_prompts_and_count_tokens_before_dropping():
    from anytime.learner.ppo import loss_spec

    batch = _train_batch()
    minis = list(batch.mini_batches(2))
    assert [m.prompts for m in minis] == [[0, 1], [2, 3], [4]]
    assert [sorted(set(m.batch.prompt_index.tolist())) for m in minis] == [[0, 1], [2, 3], []]
    constant = [loss_spec(AlgorithmConfig(loss_agg="constant"), m, batch) for m in minis]
    assert [s.num_rows for s in constant] == [4, 4, 2]  # traces of the mini-batch's prompts
    tokens = loss_spec(AlgorithmConfig(loss_agg="token-mean"), minis[2], batch).num_tokens
    assert tokens == batch.tokens_per_prompt[4] > 0  # dropped rows still count in the normaliser
    assert sum(len(m.batch) for m in minis) == len(batch)


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_anytime_train_with_a_two_stage_pipeline(tmp_path):
    from anytime.learner import checkpoint as ckpt
    from anytime.trainer.launch import launch_train
    from tests.helpers import read_metrics, tiny_overrides

    out = tmp_path / "run"
    overrides = tiny_overrides(out, steps=2) + ["learner.pipeline.stages=2", "learner.pipeline.schedule=zb-h1",
                                                "learner.pipeline.microbatches=2", "model.dtype=float32"]
    assert launch_train(QUICKSTART, overrides) == 0
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["update/grad_norm"] > 0 and m["update/skipped_updates"] == 0.0
        assert m["train/logprob_mismatch"] < 1e-3  # pipelined learner log-probs agree with the engine's
    saved = ckpt.list_checkpoints(out / "checkpoints")
    assert [p.name for p in saved] == ["step_1", "step_2"]
    assert sorted(p.name for p in saved[-1].glob("pipeline_rank*.pt")) == ["pipeline_rank0.pt", "pipeline_rank1.pt"]
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(out.parent / "init").state_dict()
    trained = AutoModelForCausalLM.from_pretrained(saved[-1] / "model").state_dict()
    moved = {k for k, v in trained.items() if not torch.equal(v, init[k])}
    assert "model.embed_tokens.weight" in moved and "lm_head.weight" in moved  # both stages trained
    flat = first_step_equals_the_flat_one(tmp_path, metrics)
    piped = AutoModelForCausalLM.from_pretrained(saved[0] / "model").state_dict()
    single = AutoModelForCausalLM.from_pretrained(flat / "checkpoints" / "step_1" / "model").state_dict()
    assert max(float((piped[k] - single[k]).abs().max()) for k in single) < 1e-5
    assert max(float((piped[k] - init[k]).abs().max()) for k in single) > 1e-5


def first_step_equals_the_flat_one(tmp_path: Path, metrics: dict, extra: tuple[str, ...] = ()) -> Path:
    """The same first step unpipelined (one process, same rollout): the same update up to float32
    rounding. Returns the flat run's folder."""
    from anytime.trainer.launch import launch_train
    from tests.helpers import read_metrics, tiny_overrides

    flat = tmp_path / "flat"
    assert launch_train(QUICKSTART, tiny_overrides(flat, steps=1) + ["model.dtype=float32", *extra]) == 0
    a, b = metrics[1], read_metrics(flat)[1]
    assert a["train/rows"] == b["train/rows"]
    for key in ("update/loss", "update/grad_norm", "update/entropy", "update/tokens"):
        assert a[key] == pytest.approx(b[key], rel=1e-4), key
    return flat
