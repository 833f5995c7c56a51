"""The trainer's weight sync with sleeping engines (`rollout.enable_sleep`, a colocated GPU engine): the
learner's weights are gathered while the engine still sleeps, the learner's cached device blocks are
returned before the engine wakes into that memory, then the engine wakes and loads them (round 6, finding 4:
the engine used to wake first, beside the learner's gathered weights and its cached blocks)."""

from __future__ import annotations

import pytest
import torch

from anytime.config import load_recipe
from anytime.config.placement_plan import placement_plan
from anytime.trainer.trainer import Trainer
from tests.helpers import QUICKSTART

pytestmark = pytest.mark.unit


class Learner:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def full_state_dict(self, all_ranks: bool = False) -> dict:
        self.calls.append(("full_state_dict", all_ranks))
        return {"w": torch.zeros(1)}

    def adapter_update(self) -> list:
        self.calls.append(("adapter_update",))
        return [("q.weight", torch.zeros(1, 2), torch.zeros(2, 1), 1.0)]


class Rollouts:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def wake_up(self) -> None:
        self.calls.append(("wake_up",))

    def sync_weights(self, weights) -> None:
        self.calls.append(("sync_weights", weights.version, sorted(weights.state or {}), weights.adapter is not None))


def trainer(monkeypatch, *overrides: str) -> tuple[Trainer, list]:
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU machine: the allocator has a cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    t = Trainer.__new__(Trainer)
    t.recipe = load_recipe(QUICKSTART, ["rollout.enable_sleep=true", *overrides])
    t.plan = placement_plan(t.recipe)
    t.learner, t.rollouts = Learner(calls), Rollouts(calls)
    return t, calls


def test_weights_are_gathered_and_the_cache_freed_before_the_engine_wakes(monkeypatch):
    t, calls = trainer(monkeypatch)
    t._sync_weights(3)
    assert calls == [("full_state_dict", False), ("empty_cache",), ("wake_up",), ("sync_weights", 3, ["w"], False)]
    assert t._weights_version == 3


def test_colocated_engines_gather_on_every_rank_and_lora_adapters_travel_alone(monkeypatch):
    t, calls = trainer(monkeypatch, "learner.num_processes=2", "rollout.placement=colocated")
    t._sync_weights(1)
    assert calls[0] == ("full_state_dict", True)
    t, calls = trainer(monkeypatch, "learner.lora.rank=4", "rollout.engine=hf")
    t._sync_weights(1)
    assert calls == [("adapter_update",), ("empty_cache",), ("wake_up",), ("sync_weights", 1, [], True)]


def test_without_sleep_nothing_is_freed_and_nothing_wakes(monkeypatch):
    t, calls = trainer(monkeypatch)
    t.recipe = load_recipe(QUICKSTART)
    t._sync_weights(2)
    assert calls == [("full_state_dict", False), ("sync_weights", 2, ["w"], False)]
