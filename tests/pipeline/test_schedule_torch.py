"""Every generated schedule passes PyTorch's own schedule checks (torch.distributed.pipelining)."""

from __future__ import annotations

import pytest

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
_Action = schedules._Action
_ComputationType = schedules._ComputationType

from anytime.pipeline import SCHEDULES
from anytime.pipeline.schedule import build_schedule  # noqa: E402

pytestmark = pytest.mark.unit


def _grid(name: str) -> list[tuple[int, int]]:
    out = []
    for p in (2, 4, 8):
        for m in (p, 2 * p, 3 * p + 1):
            if name == "interleaved-1f1b" and m == 3 * p + 1:
                m = 3 * p  # interleaved needs m divisible by m // p
            out.append((p, m))
    return out


@pytest.mark.parametrize("name", SCHEDULES.names())
def test_schedule_loads_validates_and_lowers_in_torch(name: str) -> None:
    for p, m in _grid(name):
        sched = build_schedule(name, p, m)
        actions = {r: [_Action.from_str(str(a)) for a in acts] for r, acts in sched.actions.items()}
        for r, acts in actions.items():
            assert [str(a) for a in acts] == [str(a) for a in sched.actions[r]]
        stage_to_rank = schedules._validate_schedule(actions, p, sched.stages, m)
        assert stage_to_rank == dict(enumerate(sched.placement))
        lowered = schedules._add_send_recv(
            {r: list(a) for r, a in actions.items()}, lambda s: sched.placement[s], sched.stages
        )
        sends, recvs = set(), set()
        for r, acts in lowered.items():
            compute = [a for a in acts if a.is_compute_op]
            assert compute == actions[r]  # lowering keeps the compute order
            for a in acts:
                kind = a.computation_type
                if kind in (_ComputationType.SEND_F, _ComputationType.SEND_B):
                    sends.add((kind.value[-1], a.stage_index, a.microbatch_index))
                elif kind in (_ComputationType.RECV_F, _ComputationType.RECV_B):
                    src = a.stage_index - 1 if kind == _ComputationType.RECV_F else a.stage_index + 1
                    recvs.add((kind.value[-1], src, a.microbatch_index))
        assert sends == recvs and sends  # every send has its receive
