"""torch.distributed helpers every part of the system shares: rank and world, reductions of small
statistics, and the scatter that gives each learner rank its own rows of a step.

All of them work without an initialised process group (a world of one), so single-process code
calls them unconditionally.
"""

from __future__ import annotations

import os
from datetime import timedelta
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in `group` (the default group when None); (0, 1) without one."""
    if initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def is_main() -> bool:
    return rank_world()[0] == 0


def barrier() -> None:
    if initialized():
        dist.barrier()


def init_from_env(timeout_minutes: float | None = None) -> None:
    """Join the process group a launcher (torchrun, `anytime train`) described in the environment, each
    rank on its own GPU (LOCAL_RANK). A collective fails after `timeout_minutes` of waiting (torch's
    default when None: 10 minutes under NCCL): the other ranks wait that long in one while rank 0 runs
    the warm start or the held-out eval alone."""
    if "RANK" in os.environ and not initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = {} if timeout_minutes is None else {"timeout": timedelta(minutes=timeout_minutes)}
        # No device_id: binding one makes torch (2.13) create every group's NCCL communicator
        # eagerly and then run all point-to-point messages of a group on that one communicator and
        # stream, where the pipeline's receives posted ahead block the sends behind them. Left
        # lazy, each (group, rank pair) gets its own; the executor creates them in one order.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", **timeout)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors must live to take part in collectives of `group` (NCCL: the GPU)."""
    if initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """A small picklable object (metrics, a path) from `src` to every rank. Not for batches."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def sum_across_ranks(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    if rank_world(group)[1] == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, group=group)
    return t.tolist()


def max_across_ranks(value: int, group: dist.ProcessGroup | None = None) -> int:
    if rank_world(group)[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def any_across_ranks(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    return max_across_ranks(int(flag), group) > 0


def sum_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of `params` over `group` in place, one message per dtype and device.

    The loss normaliser is global (see `anytime.learner.ppo.loss_spec`): each data-parallel
    replica's gradient is its share of the mini-batch gradient, so shares are summed, not averaged.
    Parameters without a gradient are left out; every rank must hold gradients for the same ones
    (replicas run the same passes, so they do).
    """
    if rank_world(group)[1] == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def scatter_tensors(shares: Sequence[Mapping[str, torch.Tensor]] | None, src: int = 0) -> dict[str, torch.Tensor]:
    """Give rank r the tensors `shares[r]` (on `src`, which holds them all; None elsewhere).

    Only names, shapes and dtypes travel as objects; every tensor goes point to point to the one
    rank that needs it, so no rank receives another rank's rows. Returns CPU tensors.
    """
    rank, world = rank_world()
    if world == 1:
        assert shares is not None
        return dict(shares[0])
    layouts = None
    if rank == src:
        assert shares is not None and len(shares) == world, "scatter_tensors needs one share per rank"
        layouts = [[(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in share.items()]
                   for share in shares]
    box: list[Any] = [None]
    dist.scatter_object_list(box, layouts, src=src)
    device = collective_device()
    if rank == src:
        sending = []
        for dst, share in enumerate(shares):  # type: ignore[arg-type]
            if dst == src:
                continue
            for t in share.values():
                wire = _to_wire(t).to(device)
                sending.append((dist.isend(wire, dst), wire))  # keep `wire` alive until sent
        for request, _ in sending:
            request.wait()
        return dict(shares[src])  # type: ignore[index]
    out = {}
    for name, shape, dtype in box[0]:
        target = getattr(torch, dtype)
        wire = torch.empty(shape, dtype=torch.uint8 if target == torch.bool else target, device=device)
        dist.recv(wire, src)
        out[name] = wire.to("cpu", target)
    return out


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """A small picklable object (metric sums, timings) from every rank of `group`."""
    if rank_world(group)[1] == 1:
        return [obj]
    out: list[Any] = [None] * rank_world(group)[1]
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_tensors(tensors: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None
                       ) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors (of any shapes) on every rank of `group`, in group-rank order: the
    layouts travel as objects, each tensor by one broadcast from its owner. Returns CPU tensors."""
    if rank_world(group)[1] == 1:
        return [dict(tensors)]
    layouts = all_gather_object([(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()],
                                group)
    device, me = collective_device(), rank_world(group)[0]
    out = []
    for src, layout in enumerate(layouts):
        owner = dist.get_global_rank(group, src) if group is not None else src
        got = {}
        for name, shape, dtype in layout:
            target = getattr(torch, dtype)
            if src == me:
                wire = _to_wire(tensors[name]).to(device)
            else:
                wire = torch.empty(shape, dtype=torch.uint8 if target == torch.bool else target, device=device)
            dist.broadcast(wire, owner, group=group)
            got[name] = wire.to("cpu", target)
        out.append(got)
    return out


def local_share(items: Sequence[Any], index: int, count: int) -> list[Any]:
    """The `index`-th of `count` near-equal contiguous shares of `items` (every item in exactly one)."""
    n = len(items)
    return list(items[index * n // count: (index + 1) * n // count])


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool type; bytes carry the same values
    return (t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous()
