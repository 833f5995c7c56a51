"""Pipelined learners on a (pipeline × data-parallel) mesh: 4 gloo processes = 2 stages × 2 replicas.

- the torch pipelined learner on the mesh: one RL update equals the unpipelined, single-process
  torch learner on all rows (fp64, <= 1e-10), checkpoint resume included;
- DeepSpeed ZeRO-1 and ZeRO-2 per stage on zb-h1 and zb-v, with the blocking step and with
  optimizer post-validation: the same update as the single-process torch learner in fp32
  (<= 1e-6); a NaN gradient on one rank skips the step on every rank (both ways); resume is exact;
  `anytime export` of the mesh checkpoint passes its parity check.

The replicas split the rows by prompt and the loss normaliser is global, so each equality also
checks that the replicas' gradients are summed (not averaged) and clipped by the norm over the
whole mesh.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from anytime.config import AlgorithmConfig, LearnerConfig, PipelineConfig
from tests.learner.test_pipeline_learner import _max_diff, _model_dir, _train_batch, first_step_equals_the_flat_one
from tests.learner.test_pipeline_learner import _reference as pipeline_reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORLD, STAGES = 4, 2
REPLICAS = WORLD // STAGES
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")

# Each case: learner backend, ZeRO stage, schedule, microbatches, model, loss aggregation, clipping,
# prompts per PPO mini-batch (3: one replica's share of the last mini-batch is empty).
# Tied embeddings: on zb-h1 the embedding (stage 0) and the LM head (stage 1) sit on different ranks,
# two copies whose gradients are summed and must count once in the clip norm; on zb-v both are on
# rank 0, one weight.
TORCH_CASES = [
    {"id": "torch-zb-h1-tied-clipped", "backend": "torch", "zero": 0, "schedule": "zb-h1", "m": 2, "tied": True,
     "agg": "constant", "grad_clip": 1e-3, "prompts": 2, "epochs": 1},
    {"id": "torch-zb-v", "backend": "torch", "zero": 0, "schedule": "zb-v", "m": 2, "tied": False,
     "agg": "seq-mean-token-mean", "grad_clip": 1.0, "prompts": 3, "epochs": 2},
]
# The last two: optimizer post-validation on top of ZeRO (speculative step; with clipping at 1e-3
# every step is rolled back and redone with the global clip coefficient).
DS_CASES = [
    {"id": f"zero{zero}-{schedule}{'-tied' if tied else ''}{'-postvalidated' if post else ''}",
     "backend": "deepspeed", "zero": zero, "schedule": schedule, "m": 2, "tied": tied, "agg": agg, "grad_clip": clip,
     "prompts": prompts, "epochs": 1, "post_validate": post}
    for zero, schedule, tied, agg, clip, prompts, post in [
        (1, "zb-h1", False, "token-mean", 1.0, 2, False), (2, "zb-h1", True, "constant", 1e-3, 3, False),
        (1, "zb-v", True, "seq-mean-token-mean", 1e-3, 3, False), (2, "zb-v", False, "token-mean", 1.0, 2, False),
        (2, "zb-h1", False, "token-mean", 1e-3, 2, True), (1, "zb-v", True, "constant", 1.0, 3, True)]
] + [  # bf16 weights (DeepSpeed's fp32 master weights): the fp32 update within bf16 rounding
    {"id": "zero2-zb-h1-bf16", "backend": "deepspeed", "zero": 2, "schedule": "zb-h1", "m": 2, "tied": False,
     "agg": "token-mean", "grad_clip": 1.0, "prompts": 2, "epochs": 1, "post_validate": False, "bf16": True}]


def _configs(case: dict) -> tuple[AlgorithmConfig, LearnerConfig]:
    algo = AlgorithmConfig(loss_agg=case["agg"], entropy_coef=0.01, clip_low=0.2, clip_high=0.28)
    cfg = LearnerConfig(backend=case["backend"], zero_stage=max(case["zero"], 1), bf16=case.get("bf16", False),
                        lr=1e-3, weight_decay=0.1,
                        grad_clip=case["grad_clip"], ppo_epochs=case["epochs"], mini_batch_prompts=case["prompts"],
                        micro_batch_tokens=10**6, lr_schedule="cosine", warmup_steps=1, num_processes=WORLD,
                        pipeline=PipelineConfig(stages=STAGES, schedule=case["schedule"], microbatches=case["m"],
                                                post_validate=case.get("post_validate")))
    return algo, cfg


def _reference(model_dir: str, case: dict, dtype: torch.dtype) -> dict:
    """The unpipelined RL update of every row on one process (plain torch AdamW)."""
    return pipeline_reference(model_dir, case, dtype, configs=_configs)


def _learner(case: dict, model_dir: str, dtype: torch.dtype):
    from anytime.learner.factory import learner_class

    _, cfg = _configs(case)
    return learner_class(True, case["backend"])(model_dir, cfg, total_steps=10, dtype=dtype)


def _update(learner, case: dict):
    """This rank's replica share of the batch: old log-probs, then the PPO loop."""
    from anytime.learner.ppo import ppo_update

    algo, cfg = _configs(case)
    batch = _train_batch().shard(learner.mesh.replica, learner.dp_size)
    batch.old_logprobs = learner.logprobs(batch)
    return batch, ppo_update(learner, batch, algo, cfg)


def _run_cases(rank: int, out_dir: str, dirs: dict, cases: list[dict], dtype: torch.dtype) -> None:
    for case in cases:
        learner = _learner(case, dirs["tied" if case["tied"] else "untied"],
                           torch.bfloat16 if case.get("bf16") else dtype)
        batch, stats = _update(learner, case)
        torch.save({"weights": learner.model.full_state_dict(dst=None), "stats": stats,
                    "old_logprobs": batch.old_logprobs, "replica": learner.mesh.replica,
                    "stage": learner.mesh.stage_rank},
                   os.path.join(out_dir, f"{case['id']}.rank{rank}.pt"))


def _spawned(rank: int, init_file: str, body, *args) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # as a launcher sets it (DeepSpeed asks)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        body(rank, *args)
    finally:
        dist.destroy_process_group()


def _check_cases(tmp_path: Path, dirs: dict, cases: list[dict], dtype: torch.dtype, tol: float,
                 weight_tol: float | None = None) -> dict:
    """Every rank's full model and statistics against the single-process reference (the worst
    weight difference per case; for bf16 cases the cosine of the update with the reference's).
    `weight_tol` (default `tol`) bounds the weights apart from the log-probs and statistics."""
    worst = {}
    for case in cases:
        model_dir = dirs["tied" if case["tied"] else "untied"]
        ref = _reference(model_dir, case, dtype)
        start = _reference_start(model_dir, dtype)
        assert _max_diff(ref["weights"], start) > 1e-4, "test setup: the update must move the weights"
        batch = _train_batch()
        bf16 = case.get("bf16", False)
        # bf16 rounds every weight and activation: its statistics agree to ~1e-3, its weights only within
        # bf16 rounding (larger than one update), so the update's direction is compared instead.
        case_weight_tol, lp_tol, stat_tol = (None, 5e-2, 1e-2) if bf16 else (tol if weight_tol is None else weight_tol, tol, 10 * tol)
        worst[case["id"]] = 1.0 if bf16 else 0.0
        for r in range(WORLD):
            run = torch.load(tmp_path / f"{case['id']}.rank{r}.pt")
            where = f"{case['id']} rank {r}"
            if bf16:
                cos = _update_cosine(run["weights"], ref["weights"], start)
                worst[case["id"]] = min(worst[case["id"]], cos)
                assert cos >= 0.95, f"{where}: the bf16 update points elsewhere (cosine {cos})"
            else:
                err = _max_diff(run["weights"], ref["weights"])
                worst[case["id"]] = max(worst[case["id"]], err)
                assert err <= case_weight_tol, f"{where}: weights differ by {err}"
            rows = (batch.prompt_index % REPLICAS == run["replica"]).nonzero().flatten()
            mine = ref["old_logprobs"][rows]
            got = run["old_logprobs"]
            lp_err = float((got - mine[:, : got.shape[1]]).abs().max())
            assert lp_err <= lp_tol, f"{where}: old logprobs differ by {lp_err}"
            assert set(run["stats"]) == set(ref["stats"]), where
            for k, v in ref["stats"].items():
                assert abs(run["stats"][k] - v) <= stat_tol * max(1.0, abs(v)), f"{where}: {k} {run['stats'][k]} vs {v}"
    return worst


def _update_cosine(weights: dict, ref: dict, start: dict) -> float:
    """Cosine between the update from `start` to `weights` (rounded from `start` to their dtype) and the reference's."""
    a = torch.cat([(weights[k].double() - start[k].to(weights[k].dtype).double()).flatten() for k in ref])
    b = torch.cat([(ref[k].double() - start[k].double()).flatten() for k in ref])
    return float(a @ b / (a.norm() * b.norm()))


def _reference_start(model_dir: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the torch pipelined learner on the mesh, fp64 ------------------------------------------------

def _torch_body(rank: int, out_dir: str, dirs: dict) -> None:
    _run_cases(rank, out_dir, dirs, TORCH_CASES, torch.float64)
    _resume(rank, out_dir, dirs, TORCH_CASES[0], torch.float64)


def _resume(rank: int, out_dir: str, dirs: dict, case: dict, dtype: torch.dtype) -> None:
    """One update, a checkpoint, a fresh learner resumed from it; one more update on both."""
    from anytime.learner import checkpoint as ckpt

    model_dir = dirs["tied" if case["tied"] else "untied"]
    learner = _learner(case, model_dir, dtype)
    _update(learner, case)
    path = ckpt.save_checkpoint(Path(out_dir) / f"checkpoints-{case['id']}", 1, learner, None, {"data_position": 1},
                                keep_last=2, generation_source=model_dir)
    fresh = _learner(case, model_dir, dtype)
    state = ckpt.load_checkpoint(path, fresh)
    loaded = _max_diff(fresh.model.state_dict(), learner.model.state_dict())
    for lrn in (learner, fresh):
        _update(lrn, case)
    after = _max_diff(fresh.model.state_dict(), learner.model.state_dict())
    with open(os.path.join(out_dir, f"resume-{case['id']}.rank{rank}.json"), "w") as f:
        json.dump({"step": state["step"], "loaded_err": loaded, "after_err": after,
                   "lr": [fresh.optimizer.param_groups[0]["lr"], learner.optimizer.param_groups[0]["lr"]],
                   "path": str(path)}, f)


def _check_resume(tmp_path: Path, case: dict) -> None:
    for r in range(WORLD):
        got = json.loads((tmp_path / f"resume-{case['id']}.rank{r}.json").read_text())
        assert got["step"] == 1 and got["loaded_err"] == 0.0, got
        assert got["after_err"] == 0.0 and got["lr"][0] == got["lr"][1], got


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torch_pipeline_on_a_mesh_equals_the_single_process_update(tmp_path):
    dirs = {"tied": _model_dir(tmp_path, True), "untied": _model_dir(tmp_path, False)}
    mp.spawn(_spawned, args=(str(tmp_path / "store"), _torch_body, str(tmp_path), dirs), nprocs=WORLD)
    worst = _check_cases(tmp_path, dirs, TORCH_CASES, torch.float64, 1e-10)
    print("max |weights - reference| (fp64):", worst)
    _check_resume(tmp_path, TORCH_CASES[0])


# -- DeepSpeed ZeRO-1/2 per stage, fp32 -----------------------------------------------------------

def _ds_body(rank: int, out_dir: str, dirs: dict, cases: list[dict]) -> None:
    _run_cases(rank, out_dir, dirs, cases, torch.float32)


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.deepspeed
@needs_deepspeed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("part", ["blocking", "post-validated-and-bf16"])
def test_deepspeed_zero_on_a_mesh_equals_the_single_process_update(tmp_path, part):
    cases = [c for c in DS_CASES if (c["post_validate"] or c.get("bf16", False)) == (part != "blocking")]
    shm_before = set(os.listdir("/dev/shm"))
    dirs = {"tied": _model_dir(tmp_path, True), "untied": _model_dir(tmp_path, False)}
    mp.spawn(_spawned, args=(str(tmp_path / "store"), _ds_body, str(tmp_path), dirs, cases), nprocs=WORLD)
    # Weights within 1e-5, 1% of one Adam step (lr 1e-3): Adam divides each gradient by its own root
    # mean square, so where a gradient is near zero float32 summation-order noise (ZeRO's reduce vs
    # one process's backward) moves the update by up to ~lr; CI saw 1.5e-6. A lost shard or a missing
    # gradient moves weights by a whole step.
    worst = _check_cases(tmp_path, dirs, cases, torch.float32, 1e-6, weight_tol=1e-5)
    print("max |weights - reference| (fp32):", worst)
    # DeepSpeed's shared-memory all-reduce (buffers `deepspeed_allreduce_buffer_*`) was not used; other
    # names come and go with the test running beside this one (multiprocessing's `sem.mp-*`)
    assert not [f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("deepspeed")]


def _ds_nan_and_resume_body(rank: int, out_dir: str, dirs: dict) -> None:
    for case in (DS_CASES[1], DS_CASES[4]):  # the blocking step, then post-validation (a rollback)
        learner = _learner(case, dirs["tied" if case["tied"] else "untied"], torch.float32)
        start = learner.model.full_state_dict(dst=None)
        if rank == WORLD - 1:  # stage 1 of replica 1 only: its final-norm gradient turns NaN
            learner.model.executor.stages[1].norm.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        lr = learner.optimizer.param_groups[0]["lr"]
        _, stats = _update(learner, case)
        moved = _max_diff(learner.model.full_state_dict(dst=None), start)
        with open(os.path.join(out_dir, f"nan-{case['id']}.rank{rank}.json"), "w") as f:
            json.dump({"stats": stats, "moved": moved, "lr": [lr, learner.optimizer.param_groups[0]["lr"]]}, f)
    _dropped_gradient(rank, out_dir, dirs, DS_CASES[1])
    _resume(rank, out_dir, dirs, DS_CASES[1], torch.float32)


def _dropped_gradient(rank: int, out_dir: str, dirs: dict, case: dict) -> None:
    """The PPO loop drops a mini-batch whose loss is non-finite with `zero_grad()` after its
    schedule (and ZeRO's reduction) ran: the next step must equal a step without it."""
    from anytime.learner.ppo import loss_spec

    algo, _ = _configs(case)
    weights = []
    for drop_first in (False, True):
        learner = _learner(case, dirs["tied" if case["tied"] else "untied"], torch.float32)
        batch = _train_batch().shard(learner.mesh.replica, learner.dp_size)
        batch.old_logprobs = learner.logprobs(batch)
        mini = next(iter(batch.mini_batches(len(batch.tokens_per_prompt), learner.mesh.replica, learner.dp_size)))
        spec = loss_spec(algo, mini, batch)
        if drop_first:
            learner.forward_backward(mini.batch, spec)
            learner.zero_grad()
        learner.forward_backward(mini.batch, spec)
        learner.optimizer_step()
        weights.append(learner.model.full_state_dict(dst=None))
    with open(os.path.join(out_dir, f"dropped.rank{rank}.json"), "w") as f:
        json.dump({"diff": _max_diff(*weights)}, f)


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.deepspeed
@needs_deepspeed
@pytest.mark.timeout(300)
def test_deepspeed_mesh_skips_a_nan_on_every_rank_resumes_exactly_and_exports(tmp_path):
    """Also: a mini-batch dropped after its schedule ran leaves no trace in ZeRO's gradients."""
    from safetensors.torch import load_file

    from anytime.serving.export import export_checkpoint, learner_state_dict

    dirs = {"tied": _model_dir(tmp_path, True), "untied": _model_dir(tmp_path, False)}
    mp.spawn(_spawned, args=(str(tmp_path / "store"), _ds_nan_and_resume_body, str(tmp_path), dirs), nprocs=WORLD)
    for case, tol in ((DS_CASES[1], 0.0), (DS_CASES[4], 1e-6)):  # a rolled-back step: AdamW's inverse, in fp32
        for r in range(WORLD):
            got = json.loads((tmp_path / f"nan-{case['id']}.rank{r}.json").read_text())
            trained = 2  # mini-batches with rows: every one was skipped, on every rank
            assert got["stats"]["skipped_updates"] == trained and "loss" not in got["stats"], (case["id"], r, got)
            assert got["moved"] <= tol and got["lr"][0] == got["lr"][1], (case["id"], r, got)
    for r in range(WORLD):
        assert json.loads((tmp_path / f"dropped.rank{r}.json").read_text())["diff"] == 0.0
    _check_resume(tmp_path, DS_CASES[1])
    step = Path(json.loads((tmp_path / f"resume-{DS_CASES[1]['id']}.rank0.json").read_text())["path"])
    assert sorted(p.name for p in (step / "deepspeed").glob("mp_rank_*")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    from anytime.tasks import synthetic
    from anytime.models.tiny import _train_tokenizer

    _train_tokenizer(synthetic.corpus(20), 300).save_pretrained(step / "model")  # the test model came without one
    exported, diff = export_checkpoint(step, tmp_path / "hf")
    assert diff <= 1e-5
    consolidated = learner_state_dict(step)        # DeepSpeed's fp32 master weights, stage by stage
    saved = load_file(str(step / "model" / "model.safetensors"))   # the learner's full model
    # A tied model's folder keeps the embedding only; the mesh holds the LM head's copy on stage 1 too.
    assert set(saved) <= set(consolidated) <= set(saved) | {"lm_head.weight"}
    assert all(torch.equal(consolidated[k], saved[k]) for k in saved)
    if "lm_head.weight" in consolidated:
        assert torch.equal(consolidated["lm_head.weight"], saved["model.embed_tokens.weight"])
    out = load_file(str(exported / "model.safetensors"))
    assert all(torch.equal(out[k], saved[k]) for k in out)


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.deepspeed
@needs_deepspeed
@pytest.mark.timeout(600)
def test_anytime_train_with_deepspeed_on_a_two_by_two_mesh(tmp_path):
    """`anytime train` itself: 4 processes = 2 stages × 2 replicas, DeepSpeed ZeRO-1 per stage; its first
    update equals the single-process torch learner's on the same rollout (float32 rounding)."""
    from anytime.learner import checkpoint as ckpt
    from anytime.trainer.launch import launch_train
    from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

    shm_before = set(os.listdir("/dev/shm"))
    out = tmp_path / "run"
    mesh = ["learner.backend=deepspeed", "learner.zero_stage=1", "learner.pipeline.stages=2",
            "learner.num_processes=4", "learner.pipeline.microbatches=2", "model.dtype=float32",
            "rollout.prompts_per_step=4"]  # colocated rollout: a prompt per learner process
    assert launch_train(QUICKSTART, tiny_overrides(out, steps=2) + mesh) == 0
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["update/grad_norm"] > 0 and m["update/skipped_updates"] == 0.0
        assert m["train/logprob_mismatch"] < 1e-3  # the mesh's log-probs agree with the engine's
    step = ckpt.list_checkpoints(out / "checkpoints")[-1]
    names = sorted(p.name for p in (step / "deepspeed").glob("*.pt"))
    assert names == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"] + [
        f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(2) for s in range(2)]
    first_step_equals_the_flat_one(tmp_path, metrics, ("rollout.prompts_per_step=4",))
    from tests.helpers import written_here_or_orphaned

    assert written_here_or_orphaned(set(os.listdir("/dev/shm")) - shm_before) == set()
