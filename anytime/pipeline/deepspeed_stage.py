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

DeepSpeed keeps fp32 master weights, so float64 parameters are not float64 here: exactness tests in
float64 stay on the torch pipeline.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from anytime.dist import sum_across_ranks
from anytime.pipeline.causal_lm import PipelinedCausalLM
from anytime.pipeline.postvalidate import Validation

PIPE_REPLICATED = "ds_pipe_replicated"   # DeepSpeed's attribute for weights held by two stages
PIPELINE_ZERO_STAGES = (1, 2)


class MeshMPU:
    """The model-parallel unit DeepSpeed queries for its groups, over the learner's mesh:
    model parallelism = this replica's pipeline (its rank = the stage rank), data parallelism =
    the replicas of this rank's stages, no tensor parallelism."""

    def __init__(self, pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup) -> None:
        self.pp_group, self.dp_group = pp_group, dp_group

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.pp_group

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.pp_group)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.pp_group)

    get_pipeline_model_parallel_group = get_model_parallel_group
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
        ds = self._ds
        self.engine, optimizer, self.scheduler = initialize_engine(
            self.module, self.params, ds["cfg"], ds["total_steps"], zero_stage=ds["cfg"].zero_stage,
            mpu=MeshMPU(self.group, ds["dp_group"]))
        return optimizer, ZeroStageStep(self.engine, self.group, max_grad_norm)

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
    import re

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

