"""Pipelined learners on a (pipeline × data-parallel) mesh: 4 gloo processes = 2 stages × 2 replicas.

- the torch pipelined learner on the mesh: one RL update equals the unpipelined, single-process
  torch learner on all rows (fp64, <= 1e-10), checkpoint resume included;

The replicas split the rows by prompt and the loss normaliser is global, so each equality also
checks that the replicas' gradients are summed (not averaged) and clipped by the norm over the
whole mesh.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from anytime.config import AlgorithmConfig, LearnerConfig, PipelineConfig
from test_pipeline_learner import _max_diff, _model_dir, _train_batch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORLD, STAGES = 4, 2
REPLICAS = WORLD // STAGES

# Each case: learner backend, ZeRO stage, schedule, microbatches, model, loss aggregation, clipping,
# prompts per PPO mini-batch (3: one replica's share of the last mini-batch is empty).
TORCH_CASES = [
    {"id": "torch-zb-h1", "backend": "torch", "zero": 0, "schedule": "zb-h1", "m": 2, "tied": False,
     "agg": "constant", "grad_clip": 1.0, "prompts": 2, "epochs": 1},
    {"id": "torch-zb-v-tied-clipped", "backend": "torch", "zero": 0, "schedule": "zb-v", "m": 2, "tied": True,
     "agg": "seq-mean-token-mean", "grad_clip": 1e-3, "prompts": 3, "epochs": 2},
]
def _configs(case: dict) -> tuple[AlgorithmConfig, LearnerConfig]:
    algo = AlgorithmConfig(loss_agg=case["agg"], entropy_coef=0.01, clip_low=0.2, clip_high=0.28)
    cfg = LearnerConfig(backend=case["backend"], zero_stage=max(case["zero"], 1), lr=1e-3, weight_decay=0.1,
                        grad_clip=case["grad_clip"], ppo_epochs=case["epochs"], mini_batch_prompts=case["prompts"],
                        micro_batch_tokens=10**6, lr_schedule="cosine", warmup_steps=1, num_processes=WORLD,
                        pipeline=PipelineConfig(stages=STAGES, schedule=case["schedule"], microbatches=case["m"]))
    return algo, cfg


def _reference(model_dir: str, case: dict, dtype: torch.dtype) -> dict:
    """The unpipelined RL update of every row on one process (plain torch AdamW)."""
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import TorchLearner
    from anytime.learner.ppo import ppo_update

    algo, cfg = _configs(case)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    learner = TorchLearner(model, cfg, total_steps=10)
    batch = _train_batch()
    batch.old_logprobs = learner.logprobs(batch)
    stats = ppo_update(learner, batch, algo, cfg)
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "stats": stats,
            "old_logprobs": batch.old_logprobs}


def _learner(case: dict, model_dir: str, dtype: torch.dtype):
    from anytime.learner.base import learner_class

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
        learner = _learner(case, dirs["tied" if case["tied"] else "untied"], dtype)
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


def _check_cases(tmp_path: Path, dirs: dict, cases: list[dict], dtype: torch.dtype, tol: float) -> dict:
    """Every rank's full model and statistics against the single-process reference."""
    worst = {}
    for case in cases:
        model_dir = dirs["tied" if case["tied"] else "untied"]
        ref = _reference(model_dir, case, dtype)
        start = _reference_start(model_dir, dtype)
        assert _max_diff(ref["weights"], start) > 1e-4, "test setup: the update must move the weights"
        batch = _train_batch()
        worst[case["id"]] = 0.0
        for r in range(WORLD):
            run = torch.load(tmp_path / f"{case['id']}.rank{r}.pt")
            where = f"{case['id']} rank {r}"
            err = _max_diff(run["weights"], ref["weights"])
            worst[case["id"]] = max(worst[case["id"]], err)
            assert err <= tol, f"{where}: weights differ by {err}"
            rows = (batch.prompt_index % REPLICAS == run["replica"]).nonzero().flatten()
            mine = ref["old_logprobs"][rows]
            got = run["old_logprobs"]
            lp_err = float((got - mine[:, : got.shape[1]]).abs().max())
            assert lp_err <= tol, f"{where}: old logprobs differ by {lp_err}"
            assert set(run["stats"]) == set(ref["stats"]), where
            for k, v in ref["stats"].items():
                assert abs(run["stats"][k] - v) <= 10 * tol * max(1.0, abs(v)), f"{where}: {k} {run['stats'][k]} vs {v}"
    return worst


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


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torch_pipeline_on_a_mesh_equals_the_single_process_update(tmp_path):
    dirs = {"tied": _model_dir(tmp_path, True), "untied": _model_dir(tmp_path, False)}
    mp.spawn(_spawned, args=(str(tmp_path / "store"), _torch_body, str(tmp_path), dirs), nprocs=WORLD)
    worst = _check_cases(tmp_path, dirs, TORCH_CASES, torch.float64, 1e-10)
    print("max |weights - reference| (fp64):", worst)
    _check_resume(tmp_path, TORCH_CASES[0])
