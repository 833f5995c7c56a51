"""The worker pool's own rules, on a transport that records what it is asked (no worker runs): whole
prompts per worker, the offered version on every call, and which weight syncs a rollout waits for."""

from __future__ import annotations

import pytest
import torch

from anytime.batch.anytime_rollout import ScoredRollout
from anytime.batch.step_sums import StepSums
from anytime.config import load_recipe
from anytime.config.placement_plan import placement_plan
from anytime.batch.weight_snapshot import WeightSnapshot
from anytime.rollout.workers.pool import WorkerPool
from tests.helpers import QUICKSTART

pytestmark = pytest.mark.unit


class RecordingTransport:
    """Two workers whose replies are read in call order per worker, as over a pipe."""

    size = 2

    def __init__(self, recipe, plan, model_path) -> None:
        self.calls: list[tuple[int, str, tuple]] = []
        self.read: list[tuple[int, str]] = []
        self.offers: list[int] = []

    def call(self, i, method, *args):
        self.calls.append((i, method, args))
        return (i, method, len(self.calls))

    def reply(self, i, pending, what):
        self.read.append((i, pending[1]))
        return ScoredRollout([], 1, StepSums(), {}).to_state() if pending[1] == "rollout" else None

    def load_weights(self, state, version):
        return [self.call(i, "update_weights", "weights", version) for i in range(self.size)]

    def offer_weights(self, state, version):
        self.offers.append(version)

    def settle(self):
        pass

    def close(self):
        pass


class RecordingPool(WorkerPool):
    transport_type = RecordingTransport


class OneRank:
    dp_size, dp_ranks = 1, [0]

    def full_state_dict(self):
        return {"w": torch.zeros(1)}


def pool(*overrides: str) -> RecordingPool:
    recipe = load_recipe(QUICKSTART, list(overrides))
    return RecordingPool(recipe, placement_plan(recipe), "model", None, OneRank())


def weights(version: int) -> WeightSnapshot:
    return WeightSnapshot(version, state={"w": torch.zeros(1)})


def test_each_worker_gets_whole_prompts_under_their_step_indices():
    p = pool()
    p.submit([[1], [2], [3]], ["a", "b", "c"], step=4)
    rollouts = [(i, args) for i, method, args in p.transport.calls if method == "rollout"]
    assert [(i, args[3]) for i, args in rollouts] == [(0, [0]), (1, [1, 2])]
    assert rollouts[1][1][:3] == ([[2], [3]], ["b", "c"], 4) and rollouts[1][1][4:] == (3, 0)


def test_a_rollout_waits_for_the_syncs_queued_ahead_of_it_not_those_after():
    """Locked k = 2: the sync issued after step 2 was submitted sits behind it on every worker, so
    collecting step 1 must not wait for it (it would wait for step 2's rollout too)."""
    p = pool("rollout.max_staleness=2", "rollout.placement=processes")
    first = p.submit([[1]], ["a"], 1)
    p.sync_weights(weights(1))
    second = p.submit([[1]], ["a"], 2)
    p.sync_weights(weights(2))
    p.transport.read.clear()
    p.collect(first)
    assert [m for _, m in p.transport.read] == ["rollout", "rollout"]
    p.collect(second)
    assert [m for _, m in p.transport.read[2:]] == ["update_weights", "update_weights", "rollout", "rollout"]
    p.on_first_worker(len)   # the eval sees every sync issued
    assert [m for _, m in p.transport.read[6:]] == ["update_weights", "update_weights", "apply"]


def test_lock_step_reads_every_sync_before_returning():
    p = pool()
    p.sync_weights(weights(1))
    assert [m for _, m in p.transport.read] == ["update_weights", "update_weights"]


def test_in_flight_offers_and_every_later_call_names_the_version_offered():
    p = pool("rollout.staleness_mode=inflight", "rollout.max_staleness=1", "rollout.placement=processes")
    p.sync_weights(weights(3))
    assert p.transport.offers == [3] and not p.transport.read
    p.submit([[1]], ["a"], 4)
    assert p.transport.calls[-1][2][-1] == 3           # no worker starts step 4 before version 3
    p.on_first_worker(len)
    assert p.transport.calls[-1][1:] == ("apply", (len, 3))
