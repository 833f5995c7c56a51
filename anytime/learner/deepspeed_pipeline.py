"""The DeepSpeed learner on the zero-bubble pipeline (`learner.backend: deepspeed` with
`learner.pipeline.stages: P` and `learner.num_processes: P × D`): the mesh, rows and schedule of
`PipelineLearner`, with each rank's stages trained by a DeepSpeed ZeRO-1/2 engine whose
data-parallel group is the stage's D replicas (`anytime.learner.deepspeed_stage`).

DeepSpeed owns the optimizer (fp32 master weights, bf16 on the GPU with `learner.bf16`), the
gradient clipping by the norm over the whole mesh, the skip of steps with non-finite gradients on
every rank, the LR schedule and the checkpoint (one shared folder, a shard per rank). With
`learner.pipeline.post_validate: true` each stage steps at once and the clip / skip is checked
afterwards, rolled back where needed (`SpeculativeZeroStep`); the blocking step is the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anytime.learner.base import StepResult
from anytime.learner.deepspeed_learner import CHECKPOINT_TAG
from anytime.learner.pipeline_learner import PipelineLearner


class DeepSpeedPipelineLearner(PipelineLearner):
    def _build_model(self, model: Any, total_steps: int, **kwargs: Any):
        from anytime.learner.deepspeed_stage import DeepSpeedPipelinedCausalLM

        ds = {"cfg": self.cfg, "total_steps": total_steps, "dp_group": self.mesh.dp_group}
        built = DeepSpeedPipelinedCausalLM(model, self.cfg.pipeline.schedule, deepspeed=ds, **self._model_kwargs(),
                                           **kwargs)
        self.scheduler = built.scheduler
        return built

    def optimizer_step(self) -> StepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        self.model.optimizer_step()   # DeepSpeed steps its LR schedule itself (not after a skipped step)
        metrics = self.model.validate()
        return StepResult(metrics["grad_norm"], metrics["skipped"], lr)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def save(self, folder: Path) -> None:
        """Every rank writes its shard into `folder/deepspeed` (DeepSpeed names the files by stage
        and replica); the full model is saved next to it by the checkpoint code."""
        self.model.save_checkpoint(folder, CHECKPOINT_TAG)

    def load(self, folder: Path) -> None:
        from anytime.learner.checkpoint import check_deepspeed_files
        from anytime.learner.deepspeed_stage import mesh_stage_files

        ds_dir = folder / CHECKPOINT_TAG
        check_deepspeed_files(ds_dir)  # DeepSpeed's own loader unpickles them
        self._check_stages(folder, len(mesh_stage_files(ds_dir)))
        self.model.load_checkpoint(folder, CHECKPOINT_TAG)
