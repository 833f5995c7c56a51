"""Every recipe check (`anytime.config.checks`, run when a recipe loads) in one place: each refusal
names the key to change and what is allowed, and the combinations next to a refusal still load."""

import math

import pytest

from anytime.config import RecipeError, load_recipe, recipe_from_dict
from tests.helpers import QUICKSTART

pytestmark = pytest.mark.unit

LOCKED = ["rollout.max_staleness=1"]
CHAIN = "reasoning_gym:chain_sum"


BAD = [
    ({"rollout": {"nn": 4}}, r"unknown recipe key `rollout.nn`; did you mean `rollout.n`"),
    ({"rollot": {"n": 4}}, r"unknown recipe key `rollot`; did you mean `rollout`"),
    ({"budget": {"prior": "linar"}}, r"`budget.prior` must be one of .*did you mean 'linear'"),
    ({"rollout": {"n": "eight"}}, r"`rollout.n` must be an integer, got 'eight'"),
    ({"rollout": {"n": 0}}, r"`rollout.n` must be a positive integer, got 0"),
    ({"summary": {"n": -1}}, r"`summary.n` must be a positive integer"),
    ({"summary": {"max_tokens": 0}}, r"`summary.max_tokens` must be a positive integer"),
    ({"budget": {"budgets": [4000, 2000]}}, r"`budget.budgets` must be strictly increasing"),
    ({"budget": {"budgets": [2000, 2000]}}, r"`budget.budgets` must be strictly increasing"),
    ({"budget": {"budgets": [2000, 9000]}}, r"`budget.budgets` ends at 9000, above `budget.max_thinking` = 8000"),
    ({"budget": {"prior": "explicit", "probs": [0.5, 0.6, 0.0, 0.0]}}, r"`budget.probs` must sum to 1"),
    ({"budget": {"prior": "explicit", "probs": [1.5, -0.5, 0.0, 0.0]}}, r"`budget.probs` must be non-negative"),
    ({"budget": {"prior": "explicit", "probs": [0.5, 0.5]}}, r"`budget.probs` has 2 entries but there are 4 budgets"),
    ({"budget": {"prior": "explicit"}}, r"needs `budget.probs`"),
    ({"budget": {"probs": [0.25, 0.25, 0.25, 0.25]}}, r"only used with `budget.prior: explicit`"),
    ({"budget": {"max_thinking": 0}}, r"`budget.max_thinking` must be positive"),
    ({"learner": {"lr": -1}}, r"`learner.lr` must be > 0"),
    ({"learner": {"zero_stage": 4}}, r"`learner.zero_stage` must be 0, 1, 2 or 3"),
    ({"learner": {"backend": "jax"}}, r"`learner.backend` must be one of 'torch', 'deepspeed'"),
    ({"algorithm": {"estimator": "ppo"}}, r"`algorithm.estimator` must be one of"),
    ({"algorithm": {"kl_coef": 0.1}}, r"needs `learner.reference_model: true`"),
    ({"rollout": {"temperature": 0}}, r"`rollout.temperature` must be > 0"),
    ({"rollout": {"max_model_len": 4096}}, r"`rollout.max_model_len` \(4096\) is below max_prompt_len \+ max_thinking"),
    ({"summary": {"close_text": "..."}}, r"`summary.close_text` .* must end with `summary.think_end`"),
    ({"summary": {"close_text": "</think>\n\n"}}, r"`summary.close_text` '</think>\\n\\n' must end with"),
    ({"summary": {"header": " \n"}}, r"`summary.header` must not be blank"),
    ({"eval": {"budgets": [1000, 12000]}}, r"`eval.budgets` ends at 12000"),
    ({"learner": {"pipeline": {"stages": 4, "microbatches": 2}}}, r"microbatches` \(2\) must be >= stages \(4\)"),
    ({"model": ["x"]}, r"`model` must be a mapping"),
    ({"learner": {"betas": [0.9]}}, r"`learner.betas` must be two numbers"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_recipes_get_specific_messages(data, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(data)


def test_recipe_check_keeps_shared_devices_lock_step():
    with pytest.raises(RecipeError, match="colocated rollouts and `rollout.enable_sleep` share its device"):
        load_recipe(QUICKSTART, [*LOCKED, "rollout.placement=colocated"])
    with pytest.raises(RecipeError, match="share its device"):
        load_recipe(QUICKSTART, [*LOCKED, "learner.num_processes=2"])   # auto = colocated
    with pytest.raises(RecipeError, match="share its device"):   # auto = colocated: 2 stages = 2 processes
        load_recipe(QUICKSTART, [*LOCKED, "learner.pipeline.stages=2"])
    with pytest.raises(RecipeError, match="gives each of the 4 learner processes a share"):   # checked with the recipe
        load_recipe(QUICKSTART, ["learner.num_processes=4", "rollout.prompts_per_step=2"])
    with pytest.raises(RecipeError, match="max_staleness` must be >= 0"):
        load_recipe(QUICKSTART, ["rollout.max_staleness=-1"])
    assert load_recipe(QUICKSTART, [*LOCKED, "rollout.placement=ray"]).rollout.max_staleness == 1


def test_lora_recipe_checks():
    recipe = load_recipe(QUICKSTART, ["learner.lora.rank=8", "learner.lora.target_modules=[q_proj]"])
    assert recipe.learner.lora.rank == 8 and recipe.learner.lora.target_modules == ["q_proj"]
    with pytest.raises(RecipeError, match=r"learner.lora.rank.*pipelined learner.*learner.pipeline.stages=1"):
        load_recipe(QUICKSTART, ["learner.lora.rank=8", "learner.pipeline.stages=2", "learner.pipeline.microbatches=2"])
    with pytest.raises(RecipeError, match=r"learner.lora.rank.*ZeRO.*zero_stage=2"):
        load_recipe(QUICKSTART, ["learner.lora.rank=8", "learner.backend=deepspeed", "learner.zero_stage=3"])
    with pytest.raises(RecipeError, match=r"learner.lora.dropout"):
        load_recipe(QUICKSTART, ["learner.lora.rank=8", "learner.lora.dropout=1.0"])
    with pytest.raises(RecipeError, match=r"learner.lora.rank.*>= 0"):
        load_recipe(QUICKSTART, ["learner.lora.rank=-1"])


@pytest.mark.parametrize("extra, match", [
    (["rollout.placement=ray"], "needs `rollout.max_staleness` >= 1"),
    (["rollout.max_staleness=2", "rollout.placement=inprocess"], "needs workers in their own processes"),
    (["rollout.max_staleness=2", "rollout.placement=ray", "rollout.weight_sync=nccl"], "NCCL is a collective"),
    (["rollout.max_staleness=2", "rollout.placement=ray", "rollout.worker_restarts=1"], "which inflight does not keep"),
])
def test_recipe_check_refuses_what_cannot_swap_mid_generation(extra, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(QUICKSTART, ["rollout.staleness_mode=inflight", *extra])
    from anytime.config.placement_plan import resolve_placement

    auto = load_recipe(QUICKSTART, ["rollout.staleness_mode=inflight", "rollout.max_staleness=2"])
    assert resolve_placement(auto, 1) == "processes"   # auto gives in-flight workers a process of their own
    for engine in ("hf", "vllm"):
        ok = load_recipe(QUICKSTART, ["rollout.staleness_mode=inflight", "rollout.max_staleness=2",
                                      "rollout.placement=ray", f"rollout.engine={engine}"])
        assert ok.rollout.staleness_mode == "inflight"


def test_recipe_refuses_negative_counts_and_pipelines():
    from anytime.config import load_recipe
    from tests.helpers import QUICKSTART

    with pytest.raises(RecipeError, match="trainable_layers` must be >= 0"):
        load_recipe(QUICKSTART, ["learner.trainable_layers=-1"])
    with pytest.raises(RecipeError, match="pipelined learner"):
        load_recipe(QUICKSTART, ["learner.trainable_layers=1", "learner.pipeline.stages=2"])


def test_recipe_errors_name_the_key_to_change():
    with pytest.raises(RecipeError, match=r"`data.train`: .*did you mean 'reasoning_gym:chain_sum'"):
        load_recipe(None, ["data.train=reasoning_gym:chain_summ"])
    with pytest.raises(RecipeError, match=r"`eval.benchmarks`: .*did you mean 'reasoning_gym:products'"):
        load_recipe(None, ["eval.benchmarks=[reasoning_gym:product]"])
    with pytest.raises(RecipeError, match="`data.task_config` of reasoning_gym:chain_sum: .*max_termz"):
        load_recipe(None, [f"data.train={CHAIN}", "data.task_config={max_termz: 3}"])
    with pytest.raises(RecipeError, match="`data.task_config` sets the knobs of a procedural task"):
        load_recipe(None, ["data.task_config={max_terms: 3}"])
    with pytest.raises(RecipeError, match="`data.task_config` must be a mapping"):
        load_recipe(None, [f"data.train={CHAIN}", "data.task_config=[3]"])
    with pytest.raises(RecipeError, match="`data.task_size` must be a positive integer"):
        load_recipe(None, [f"data.train={CHAIN}", "data.task_size=0"])


def test_update_logprobs_are_refused_unless_the_step_is_fully_on_policy():
    from anytime.config import load_recipe
    from tests.helpers import QUICKSTART

    recipe = load_recipe(QUICKSTART, ["learner.old_logprobs=update"])   # one epoch, one mini-batch, lock-step
    assert recipe.learner.old_logprobs == "update"
    for override, says in [("learner.ppo_epochs=2", "ppo_epochs is 2"),
                           ("learner.mini_batch_prompts=4", "mini_batch_prompts (4) is below"),
                           ("rollout.max_staleness=1", "max_staleness is 1"),
                           ("algorithm.offpolicy_correction=tis", "offpolicy_correction is tis")]:
        with pytest.raises(RecipeError, match=r"set learner.old_logprobs=recompute, or: .*" + says.replace("(", r"\(")
                           .replace(")", r"\)")):
            load_recipe(QUICKSTART, ["learner.old_logprobs=update", override])


def test_worker_restarts_need_seeded_requests():
    ray = ["rollout.placement=ray", "rollout.workers=2", "rollout.worker_restarts=1"]
    with pytest.raises(RecipeError, match=r"rollout\.worker_restarts.*rollout\.seed_requests=true"):
        load_recipe(None, [*ray, "rollout.seed_requests=false"])
    assert load_recipe(None, ray).rollout.seed_requests
    assert not load_recipe(None, ["rollout.seed_requests=false"]).rollout.seed_requests


def test_recipe_checks_for_the_pipelined_learner():
    base = ["learner.pipeline.stages=2"]
    recipe = load_recipe(QUICKSTART, base + ["learner.pipeline.schedule=zb-v", "learner.pipeline.offload_chunks=[1]"])
    assert recipe.learner.pipeline.stages == 2
    bad = {
        "learner.backend=deepspeed": "supports ZeRO stages 1 and 2: set learner.zero_stage=1 or 2",
        "learner.pipeline.schedule=zb-h3": "must be one of '1f1b', .*'zb-h1'",
        "learner.num_processes=3": "must be a multiple of `learner.pipeline.stages`",
        "learner.pipeline.microbatches=1": "must be >= stages",
        "learner.pipeline.chunks=3": "chunks",
        "learner.pipeline.offload_chunks=[1]": r"chunk indices in 0\.\.0",
        "algorithm.kl_coef=0.1": "reference model",
        "model.gradient_checkpointing=true": "gradient_checkpointing",
    }
    for override, message in bad.items():
        extra = ["learner.reference_model=true"] if override.startswith("algorithm.kl_coef") else []
        extra += ["learner.zero_stage=3"] if override.startswith("learner.backend") else []
        with pytest.raises(RecipeError, match=message):
            load_recipe(QUICKSTART, base + extra + [override])
    assert load_recipe(QUICKSTART, base + ["learner.num_processes=2"]).learner.processes == 2
    assert load_recipe(QUICKSTART, base).learner.processes == 2  # 1 = one replica: a process per stage
    mesh = load_recipe(QUICKSTART, base + ["learner.num_processes=4", "learner.backend=deepspeed",
                                           "learner.zero_stage=1"]).learner
    assert (mesh.processes, mesh.pipeline.stages, mesh.backend) == (4, 2, "deepspeed")  # 2 stages × 2 replicas
    # Post-validation by default on the torch backend, the blocking step on DeepSpeed; either can be asked for.
    assert mesh.pipeline.post_validating("torch") and not mesh.pipeline.post_validating("deepspeed")
    assert load_recipe(QUICKSTART, base + ["learner.pipeline.post_validate=true"]).learner.pipeline.post_validating(
        "deepspeed")


def test_offpolicy_recipe_keys():
    default = recipe_from_dict({}).algorithm
    assert (default.offpolicy_correction, default.is_level, default.is_cap) == ("none", "token", 2.0)
    for name in ("none", "tis", "mis"):
        assert recipe_from_dict({"algorithm": {"offpolicy_correction": name}}).algorithm.offpolicy_correction == name
    assert load_recipe(None, ["algorithm.is_cap=.inf", "algorithm.is_level=sequence"]).algorithm.is_cap == math.inf
    bad = [({"offpolicy_correction": "tiss"},
            r"`algorithm.offpolicy_correction` must be one of 'none', 'tis', 'mis', got 'tiss' \(did you mean 'tis'"),
           ({"is_level": "row"}, r"`algorithm.is_level` must be one of 'token', 'sequence', got 'row'"),
           ({"is_cap": 0}, r"`algorithm.is_cap` must be > 0 \(.inf for no cap\), got 0.0"),
           ({"is_cap": -1.5}, r"`algorithm.is_cap` must be > 0"),
           ({"is_cap": float("nan")}, r"`algorithm.is_cap` must be > 0")]
    for algorithm, message in bad:
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict({"algorithm": algorithm})
