"""DeepSpeed ZeRO-1/2 under the project's pipeline executor: each pipeline stage's weights are one
DeepSpeed engine whose data-parallel group is the stage's replicas (ZeRO shards the stage's
optimizer state, and the gradients at stage 2, over them), while the executor runs any
zero-bubble schedule on the replica's pipeline.

How the two meet (measured on DeepSpeed 0.19.8; Megatron and the zero-bubble codebase do the same:
gradient sync off during the schedule, one reduction after the last W):
- the whole schedule runs inside `engine.coalesce_grad_reduction()`: ZeRO's per-parameter
  reduction hooks stay quiet during the split backward (ZeRO-2's would fire in the input-gradient
  pass, before the weight gradient exists) and one reduction over the replicas follows the
  schedule's last W; then `engine.step()`;
- DeepSpeed's `mpu` reports the replica's pipeline as the model-parallel group (tensor-parallel
  size 1): DeepSpeed then sums the squared gradient norm and ORs the overflow flag over the
  replicas *and* the stages, so every rank clips by the global norm and a NaN on any rank skips
  the step on all of them;
- the second copy of a tied weight (the LM head on the last stage when the embedding lives on
  another rank) carries `ds_pipe_replicated`, so its gradient counts once in the norm;
- checkpoints: every rank saves into one folder, DeepSpeed naming the files by model-parallel rank
  (= stage) and data-parallel rank; `consolidate_checkpoint` maps them back to full-model names.

The step blocks by default (`ZeroStageStep`); `SpeculativeZeroStep` is optimizer post-validation
on top of ZeRO (the stage steps at once and rolls back if the global state says otherwise).

DeepSpeed keeps fp32 master weights, so float64 parameters are not float64 here: exactness tests in
float64 stay on the torch pipeline.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from anytime.core.dist import sum_across_ranks
from anytime.pipeline.causal_lm import PipelinedCausalLM
from anytime.pipeline.postvalidate import GlobalState, Validation, clip_coefficient

PIPE_REPLICATED = "ds_pipe_replicated"   # DeepSpeed's attribute for weights held by two stages
PIPELINE_ZERO_STAGES = (1, 2)


class MeshMPU:
    """The model-parallel unit DeepSpeed queries for its groups, over the learner's mesh:
    model parallelism = this replica's pipeline (its rank = the stage rank, which names the
    checkpoint files), data parallelism = the replicas of this rank's stages, no tensor parallelism.

    With `reduce_across_stages=False` DeepSpeed reduces the gradient norm and the overflow flag
    over the stage's replicas only (no model-parallel group: `None` is DeepSpeed's "no such
    dimension"), for post-validation, which reduces across the stages itself.
    """

    def __init__(self, pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup,
                 reduce_across_stages: bool = True) -> None:
        self.pp_group, self.dp_group, self.reduce_across_stages = pp_group, dp_group, reduce_across_stages

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self.pp_group if self.reduce_across_stages else None

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.pp_group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.pp_group)

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.pp_group

    get_pipeline_model_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_rank = get_model_parallel_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.dp_group)

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1


class ZeroStageStep:
    """Steps a stage's DeepSpeed engine behind `PostValidator`'s interface (`step(extras)`,
    `validate()`, `pending`), so `PipelinedCausalLM` drives either. The step blocks: DeepSpeed
    reduces the norm and the overflow flag over every rank of the mesh before it steps."""

    def __init__(self, engine: Any, group: dist.ProcessGroup | None, max_grad_norm: float | None) -> None:
        from anytime.learner.deepspeed_learner import EngineStep

        self.engine, self.group, self.max_grad_norm = engine, group, max_grad_norm
        self._step = EngineStep(engine)
        self.pending = False

    def step(self, extras: Sequence[float] = ()) -> Validation:
        result = self._step()
        totals = sum_across_ranks(list(extras), group=self.group) if extras else []
        clipped = not result.skipped and self.max_grad_norm is not None and result.grad_norm > self.max_grad_norm
        return Validation(grad_norm=result.grad_norm if not result.skipped else float("inf"), clipped=clipped,
                          skipped=result.skipped, speculative=False, rolled_back=False, extras=totals)

    def validate(self) -> Validation:
        raise RuntimeError("a DeepSpeed stage step is validated when it is taken: nothing is pending")


class SpeculativeZeroStep:
    """Optimizer post-validation on top of ZeRO (zero-bubble paper §5), behind `PostValidator`'s
    interface: the stage steps without waiting for the other stages, then checks the global state.

    DeepSpeed steps with stage-local semantics (`MeshMPU(reduce_across_stages=False)`): the norm
    and the overflow flag are reduced over the stage's replicas only, so every replica of a stage
    decides alike, and it clips by the stage's norm, a lower bound of the global one (so its clip
    coefficient is never below the global one). The squared stage norm and the flag then travel
    over the pipeline in a non-blocking all-reduce. `validate()` waits for it; if the global state
    disagrees:
    - a non-finite gradient anywhere: a stage that stepped undoes its step (and its LR-schedule
      step), so the step is skipped on every rank;
    - a global clip coefficient (`torch.nn.utils.clip_grad_norm_`'s) below the stage's: the step is
      undone and redone with the gradients rescaled to the global coefficient.
    Clipping by the stage norm first keeps the undone step close in size to the kept state, so
    AdamW's inverse loses little to cancellation in float32 (undoing a far larger unclipped step
    would wipe out the second-moment estimate).
    The undo is the in-place inverse of AdamW on ZeRO's fp32 partitions, from the gradients the
    optimizer consumed (recorded by a step pre-hook: one fp32 partition of memory); DeepSpeed's
    `update_lp_params` then copies the partitions back into the model weights and all-gathers them
    over the replicas.
    """

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                 group: dist.ProcessGroup | None, max_grad_norm: float | None) -> None:
        from anytime.learner.deepspeed_learner import EngineStep
        from anytime.pipeline.postvalidate import adam_invertible

        if not adam_invertible(optimizer):
            raise ValueError("post-validation on ZeRO undoes steps with the inverse of Adam/AdamW; "
                             f"got {type(optimizer).__name__}")
        self.engine, self.optimizer, self.scheduler = engine, optimizer, scheduler
        self.group, self.max_grad_norm = group, max_grad_norm
        self._step = EngineStep(engine)
        self._consumed: dict[torch.Tensor, torch.Tensor] = {}
        optimizer.register_step_pre_hook(self._record)
        self._state: GlobalState | None = None
        self._before = self._local = None

    @property
    def pending(self) -> bool:
        return self._state is not None

    def _record(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # ZeRO steps its parameter groups one at a time, each a flat fp32 partition.
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._consumed[p] = p.grad.detach().clone()

    def step(self, extras: Sequence[float] = ()) -> None:
        if self.pending:
            raise RuntimeError("previous step not validated yet: call validate() first")
        self._consumed.clear()
        self._before = ([g["lr"] for g in self.optimizer.param_groups], self.scheduler.state_dict())
        self._local = self._step()  # stage-local: the replicas' norm and overflow, clipped by the stage norm
        self._state = GlobalState(self._local.grad_norm ** 2, self._local.skipped, extras, self.group, async_op=True)
        return None

    def validate(self) -> Validation:
        if not self.pending:
            raise RuntimeError("nothing to validate: call step() first")
        sq, nonfinite, extras = self._state.wait()
        self._state = None
        stepped = not self._local.skipped
        coef = clip_coefficient(self.max_grad_norm, math.sqrt(sq)) if not nonfinite else 1.0
        applied = clip_coefficient(self.max_grad_norm, self._local.grad_norm) if stepped else 1.0
        rolled_back = stepped and (nonfinite or coef < applied)
        if rolled_back:
            self._redo(None if nonfinite else coef / applied)
        self._consumed.clear()
        return Validation(grad_norm=math.sqrt(sq) if not nonfinite else float("inf"), clipped=coef < 1.0,
                          skipped=nonfinite, speculative=stepped, rolled_back=rolled_back, extras=extras)

    @torch.no_grad()
    def _redo(self, coef: float | None) -> None:
        """Undo the speculative step; with `coef`, take it again on the consumed gradients scaled by it."""
        from anytime.pipeline.postvalidate import undo_adam_step

        lrs, schedule = self._before
        after = [g["lr"] for g in self.optimizer.param_groups]
        for g, lr in zip(self.optimizer.param_groups, lrs):  # the step's own learning rate
            g["lr"] = lr
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params:
            p.grad = self._consumed.get(p)
        undo_adam_step(self.optimizer)
        if coef is None:  # skipped after all: the LR schedule does not advance either
            self.scheduler.load_state_dict(schedule)
            after = lrs
        else:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
            self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, after):
            g["lr"] = lr
        for p in params:
            p.grad = None
        self.engine.optimizer.update_lp_params()


class DeepSpeedPipelinedCausalLM(PipelinedCausalLM):
    """`PipelinedCausalLM` whose stages on this rank are one DeepSpeed ZeRO-1/2 engine.

    `deepspeed` holds what the engine needs: `cfg` (the `LearnerConfig`), `total_steps`, and
    `dp_group` (the stage's replicas, a group of one without replicas); `group` stays the
    replica's pipeline.
    """

    def __init__(self, model, schedule, *, deepspeed: Mapping[str, Any], **kwargs: Any) -> None:
        stage = deepspeed["cfg"].zero_stage
        if stage not in PIPELINE_ZERO_STAGES:
            raise ValueError(f"learner.zero_stage is {stage}; DeepSpeed on the pipeline supports ZeRO stages "
                             f"{' and '.join(map(str, PIPELINE_ZERO_STAGES))} (each stage's optimizer state, and "
                             "at stage 2 its gradients, sharded over the stage's replicas)")
        if kwargs.get("dp_group") is not None:
            raise ValueError("pass the replicas' group in deepspeed['dp_group']: the engine reduces over it")
        self._ds = dict(deepspeed)
        super().__init__(model, schedule, **kwargs)

    def _build_optimizer(self, norm_params: list[nn.Parameter], *, optimizer_factory, max_grad_norm: float | None,
                         post_validate: bool, rollback: str):
        from anytime.learner.deepspeed_learner import initialize_engine

        counted = {id(p) for p in norm_params}
        for p in self.params:
            setattr(p, PIPE_REPLICATED, id(p) not in counted)
        # One module over this rank's stages (a V placement holds two; a shared tied weight once).
        self.module = nn.ModuleDict({str(s): m for s, m in sorted(self.executor.stages.items())})
        ds, cfg = self._ds, self._ds["cfg"]
        if not post_validate:
            self.engine, optimizer, self.scheduler = initialize_engine(
                self.module, self.params, cfg, ds["total_steps"], zero_stage=cfg.zero_stage,
                mpu=MeshMPU(self.group, ds["dp_group"]))
            return optimizer, ZeroStageStep(self.engine, self.group, max_grad_norm)
        if rollback == "snapshot":
            raise ValueError("post-validation on ZeRO rolls back with the inverse of AdamW; rollback='snapshot' "
                             "is not available there")
        adamw = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.engine, optimizer, self.scheduler = initialize_engine(
            self.module, self.params, cfg, ds["total_steps"], zero_stage=cfg.zero_stage, optimizer=adamw,
            grad_clip=max_grad_norm or 0.0, mpu=MeshMPU(self.group, ds["dp_group"], reduce_across_stages=False))
        return optimizer, SpeculativeZeroStep(self.engine, adamw, self.scheduler, self.group, max_grad_norm)

    def forward_backward(self, batch, **kwargs: Any) -> dict:
        # One gradient reduction over the replicas, after the schedule's last W (see module doc).
        with self.engine.coalesce_grad_reduction():
            return super().forward_backward(batch, **kwargs)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path, tag: str) -> None:
        """Collective over the mesh: every rank writes its shard into the one shared `folder`."""
        self.engine.save_checkpoint(str(folder), tag=tag, save_latest=False)

    def load_checkpoint(self, folder: Path, tag: str) -> None:
        self.engine.load_checkpoint(str(folder), tag=tag, load_module_strict=True)


# -- consolidating a mesh checkpoint ------------------------------------------------------------

def mesh_stage_files(ds_dir: Path) -> dict[int, list[Path]]:
    """The files of a DeepSpeed checkpoint folder, by model-parallel rank (= pipeline stage rank)."""
    stages: dict[int, list[Path]] = {}
    for f in ds_dir.glob("*.pt"):
        m = re.search(r"mp_rank_(\d+)", f.name)
        if m:
            stages.setdefault(int(m.group(1)), []).append(f)
    return stages


def consolidate_checkpoint(ds_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a mesh checkpoint under the full model's names.

    DeepSpeed's `zero_to_fp32` reads one model-parallel rank: each stage's files are shown to it in
    a view of their own (links renamed to model-parallel rank 0), and its stage-local keys
    (`"<stage>.<name in the stage>"`) are mapped to the model's. Call `check_deepspeed_files` first:
    DeepSpeed unpickles the files.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from anytime.pipeline.partition import CausalLMStage

    out: dict[str, torch.Tensor] = {}
    for stage_rank, files in sorted(mesh_stage_files(ds_dir).items()):
        with tempfile.TemporaryDirectory() as tmp:
            view = Path(tmp) / ds_dir.name
            view.mkdir()
            for f in files:
                (view / f.name.replace(f"mp_rank_{stage_rank:02d}", "mp_rank_00")).symlink_to(f.resolve())
            state = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=ds_dir.name)
        for key, tensor in state.items():
            _, local = key.split(".", 1)
            out.setdefault(CausalLMStage.original_name(local), tensor)
    return out

