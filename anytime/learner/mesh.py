"""The learner's process mesh: P pipeline stages × D data-parallel replicas.

Global ranks are laid out pipeline-outermost, as in torchtitan and DeepSpeed's
`PipeDataParallelTopology`: rank = stage · D + replica. The D ranks holding one stage are
neighbours (on a GPU node the data-parallel reductions, the heavier traffic, stay inside the
node), and global rank 0 is stage 0 of replica 0: the rank that owns the rollout worker and
gathers the whole model.

The groups come from `torch.distributed.device_mesh.init_device_mesh`, which has every rank
create every group in the same order, as NCCL requires. The executor's second point-to-point
group per pipeline (messages to lower stages, see `anytime.pipeline.runtime.p2p_groups`) is
built here the same way, for every pipeline, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class LearnerMesh:
    """This rank's place in the (pp × dp) mesh and the groups it talks over."""

    stages: int                       # P: pipeline ranks per replica
    replicas: int                     # D: data-parallel replicas
    stage_rank: int                   # this rank's pipeline rank (0 .. P-1)
    replica: int                      # this rank's data-parallel rank (0 .. D-1)
    pp_group: dist.ProcessGroup       # the P ranks of this replica's pipeline
    dp_group: dist.ProcessGroup       # the D ranks holding this rank's stages
    pp_reverse_group: dist.ProcessGroup | None   # NCCL: this pipeline's messages to lower stages
    device_mesh: object = None        # the torch DeviceMesh the groups belong to

    @property
    def dp_ranks(self) -> list[int]:
        """The data-parallel rank of every global rank (the trainer scatters rows by it)."""
        return [rank % self.replicas for rank in range(self.stages * self.replicas)]


def build_mesh(stages: int, device_type: str = "cpu") -> LearnerMesh:
    """The mesh of the default process group, whose size must be a multiple of `stages`.
    Collective: every rank calls it once."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("a pipelined learner needs an initialised torch.distributed process group "
                         "(anytime train starts one process per rank itself)")
    world = dist.get_world_size()
    if stages < 1 or world % stages:
        raise ValueError(f"learner.pipeline.stages is {stages} but {world} learner processes are running; "
                         f"learner.num_processes must be a multiple of the stages (stages × data-parallel replicas)")
    replicas = world // stages
    mesh = init_device_mesh(device_type, (stages, replicas), mesh_dim_names=("pp", "dp"))
    reverse = None
    if dist.get_backend() == "nccl":
        # new_group is collective over the default group: create every pipeline's reverse
        # group on every rank, in the same order, and keep ours.
        me = dist.get_rank()
        for replica in range(replicas):
            ranks = [stage * replicas + replica for stage in range(stages)]
            group = dist.new_group(ranks=ranks)
            if me in ranks:
                reverse = group
    return LearnerMesh(stages, replicas, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"),
                       mesh.get_group("pp"), mesh.get_group("dp"), reverse, mesh)
