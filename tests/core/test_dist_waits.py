"""How learner ranks wait for each other, on 2 gloo processes (a hang shows as gloo's timeout):
the recipe's `trainer.dist_timeout_minutes` is the group's timeout, so ranks that wait while rank 0
works alone (the warm start, the held-out eval) fail only past it; and a weight sync on rank 0 into
an engine core of its own issues no collective the other ranks do not, so the rollout's scatter that
follows meets them."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def _join(rank: int, port: int, timeout_minutes: float) -> None:
    from anytime.core.dist import init_from_env

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    init_from_env(timeout_minutes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_zero_works_alone(rank: int, port: int, timeout_minutes: float, work_s: float, out: str) -> None:
    import torch.distributed as dist

    from anytime.core.dist import broadcast_object

    _join(rank, port, timeout_minutes)
    result: dict[str, object] = {}
    try:
        if rank == 0:
            time.sleep(work_s)   # the warm start or the held-out eval, on rank 0 only
        result["got"] = broadcast_object("model path" if rank == 0 else None)
    except Exception as exc:  # gloo's timeout
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if "error" not in result:
        dist.destroy_process_group()


def _rank_zero_works_then_leaves(rank: int, port: int, timeout_minutes: float, work_s: float, out: str) -> None:
    """Rank 1 waits in the broadcast while rank 0 works; rank 0 then leaves without broadcasting. Only
    rank 1's wait is under test: a broadcast to a rank that already gave up, or leaving with a group whose
    peer gave up, can abort a rank inside gloo (SIGABRT), which says nothing about the timeout."""
    from anytime.core.dist import broadcast_object

    _join(rank, port, timeout_minutes)
    result: dict[str, object] = {"left": True}
    if rank == 0:
        time.sleep(work_s)
    else:
        try:
            result = {"got": broadcast_object(None)}
        except Exception as exc:  # gloo's timeout
            result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # leave at once: a process group whose peer gave up can abort the interpreter's exit (SIGABRT,
    # "terminate called without an active exception"), which is not what this test is about
    os._exit(0)


def _run(tmp_path, target, *args) -> list[dict]:
    mp.spawn(target, args=(_free_port(), *args, str(tmp_path)), nprocs=2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_waiting_on_rank_zero_fail_only_past_the_recipes_timeout(tmp_path):
    (tmp_path / "short").mkdir()
    (tmp_path / "long").mkdir()
    short = _run(tmp_path / "short", _rank_zero_works_then_leaves, 0.04, 6.0)   # 2.4 s < 6 s of work alone
    assert "timed out" in short[1].get("error", "").lower(), short
    long = _run(tmp_path / "long", _rank_zero_works_alone, 0.5, 6.0)     # 30 s > 6 s
    assert long == [{"got": "model path"}, {"got": "model path"}]


def _weights_then_rollout(rank: int, port: int, timeout_minutes: float, out: str) -> None:
    """`placement: inprocess` with 2 learner ranks: rank 0 owns the engine (its core in a process of its
    own, weights by IPC) and syncs it, then both ranks take their rows of the next rollout."""
    import torch.distributed as dist

    from anytime.core.dist import scatter_tensors
    from anytime.rollout.engines.vllm.weights import IpcWeightLoader

    _join(rank, port, timeout_minutes)
    result: dict[str, object] = {}
    try:
        if rank == 0:   # the CPU twin of the CUDA IPC sender: the same calls, a shared-memory handle
            IpcWeightLoader(lambda *a, **k: None, torch.device("cpu")).load([("w", torch.ones(3))])
        shares = [{"rows": torch.full((2,), float(r))} for r in range(2)] if rank == 0 else None
        result["rows"] = scatter_tensors(shares)["rows"].tolist()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if "error" not in result:
        dist.destroy_process_group()


def test_inprocess_ipc_weight_sync_on_rank_zero_leaves_every_rank_in_the_same_collectives(tmp_path):
    results = _run(tmp_path, _weights_then_rollout, 0.2)
    assert results == [{"rows": [0.0, 0.0]}, {"rows": [1.0, 1.0]}]
