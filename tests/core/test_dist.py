"""anytime.core.dist on 2 gloo processes: each rank receives exactly its own share of a TrainBatch
(no other rank's rows), bool masks survive the wire, reductions agree. And how a rank joins NCCL."""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from anytime.batch.train_batch import TrainBatch


def _batch() -> TrainBatch:
    lengths = [3, 6, 4, 5, 2]
    R, T = len(lengths), max(lengths)
    ids = torch.arange(R * T).view(R, T)
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(R, T - 1, generator=gen) > 0.5
    return TrainBatch(ids, torch.tensor(lengths), torch.tensor([0, 0, 1, 2, 3]), mask, ~mask, torch.zeros_like(mask),
                      torch.randn(R, T - 1, generator=gen), torch.randn(R, T - 1, generator=gen), torch.zeros(R, T - 1),
                      torch.tensor([7, 8, 9, 10]), traces_per_prompt=2, max_len=33, pad_id=5)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from anytime.core.dist import any_across_ranks, max_across_ranks, scatter_tensors, sum_across_ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        shares = [_batch().shard(r, world).to_tensors() for r in range(world)] if rank == 0 else None
        mine = TrainBatch.from_tensors(scatter_tensors(shares))
        want = _batch().shard(rank, world)
        result = {name: bool(torch.equal(value, want.to_tensors()[name])) and value.dtype == want.to_tensors()[name].dtype
                  for name, value in mine.to_tensors().items()}
        result["prompts"] = mine.prompt_index.tolist()
        result["sum"] = sum_across_ranks([rank + 1.0, 2.0])
        result["max"] = max_across_ranks(rank * 7)
        result["any"] = any_across_ranks(rank == 1)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.distributed
def test_each_rank_receives_only_its_own_rows(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0].pop("prompts") == [0, 0, 2] and results[1].pop("prompts") == [1, 3]
    for r in results:
        assert r.pop("sum") == [3.0, 4.0] and r.pop("max") == 7 and r.pop("any") is True
        assert all(r.values()), r  # every field, bool masks included, arrived exactly


@pytest.mark.unit
def test_a_rank_joins_nccl_on_its_gpu_with_lazy_point_to_point_communicators(monkeypatch):
    """On a machine made to report GPUs: the process group is NCCL on LOCAL_RANK's GPU, with no
    device_id. Binding one makes torch create each group's communicator eagerly and then run every
    point-to-point message of the group on it, one stream, where the pipeline's receives posted
    ahead block the sends behind them; unbound, each (group, rank pair) gets a communicator of its
    own, created in one order by the executor's warm-up (tests/pipeline/test_communicator_order.py)."""
    from anytime.core.dist import init_from_env

    devices, joined = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: joined.append((args, kwargs)))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    init_from_env(timeout_minutes=30)
    assert devices == [3]
    assert joined == [(("nccl",), {"timeout": timedelta(minutes=30)})]
