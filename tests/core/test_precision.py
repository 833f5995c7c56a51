"""bf16 weights (`model.dtype: bfloat16`): the torch learner trains fp32 master copies of its
trainable weights under bf16 autocast, so an AdamW step at the paper's learning rate (1e-6), far
below bf16's rounding of a weight, is kept; the weights it syncs to the engine and checkpoints as a
model stay bf16, and a resume restores the fp32 masters, not their bf16 rounding.

bf16 compute per device (`anytime.core.precision`): `learner.bf16: auto` is bf16 only where the device
has a native bf16 GEMM, an explicit true is refused at the run's start on a CPU without one (torch's
reference GEMM runs bf16 ~34x slower there), and the warm start trains on the learner's device in the
same precision. Those machines are made by replacing the module's probes (and torch.cuda's)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from anytime.config import AlgorithmConfig, LearnerConfig, RecipeError, load_recipe
from anytime.core import precision
from anytime.learner.ppo import loss_spec
from tests.helpers import QUICKSTART, REPO
from tests.learner.test_old_logprobs import _batch
from tests.learner.test_seq_mean import B

LR = 1e-6


def _tiny_model(dtype: torch.dtype, tied: bool = False) -> torch.nn.Module:
    """A tiny random Qwen2 built in memory (vocabulary large enough for `_batch`'s token ids)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)


def _step(learner) -> dict[str, torch.Tensor]:
    """One on-policy PPO step on the fixed batch; returns the gradients it took."""
    batch = _batch()
    mini = next(iter(batch.mini_batches(B, 0, 1)))
    learner.forward_backward(mini.batch, loss_spec(AlgorithmConfig(), mini, batch, on_policy=True))
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    assert not learner.optimizer_step().skipped
    return grads


def _weights(learner) -> dict[str, torch.Tensor]:
    """The trainable weights as the optimizer holds them, in float32."""
    return {n: p.detach().float().clone() for n, p in learner.model.named_parameters() if p.requires_grad}


@pytest.mark.integration
def test_a_resume_restores_the_fp32_master_and_the_checkpoint_model_stays_bf16(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from anytime.config import load_recipe
    from anytime.learner import checkpoint as ckpt
    from anytime.learner.factory import build_learner
    from tests.helpers import QUICKSTART

    recipe = load_recipe(QUICKSTART, ["model.dtype=bfloat16", f"model.path={tiny_model_dir}", "model.tiny=false",
                                      f"learner.lr={LR}", f"learner.mini_batch_prompts={B}"])
    learner = build_learner(recipe, tiny_model_dir)
    for _ in range(3):
        _step(learner)
    folder = ckpt.save_checkpoint(tmp_path, 3, learner, None, {}, keep_last=1)
    saved = load_file(folder / "model" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    resumed = build_learner(recipe, tiny_model_dir)
    ckpt.load_checkpoint(folder, resumed)
    master, restored = _weights(learner), _weights(resumed)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in master.values()), "the master is bf16-exact"
    for name, weight in master.items():
        assert torch.equal(restored[name], weight), name
    _step(learner)
    _step(resumed)   # the same next step: the optimizer state was restored too
    for name, weight in _weights(learner).items():
        assert torch.equal(_weights(resumed)[name], weight), name


@pytest.mark.unit
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_lr_1e6_step_reaches_bf16_weights_through_their_fp32_master(tied):
    from anytime.learner.data_parallel import TorchLearner

    cfg = LearnerConfig(lr=LR, mini_batch_prompts=B)
    learner = TorchLearner(_tiny_model(torch.bfloat16, tied), cfg, total_steps=5)
    start, synced = _weights(learner), learner.full_state_dict()
    grads = _step(learner)
    after = _weights(learner)
    # AdamW's first step moves every weight with a nonzero gradient by about lr
    moved = sum(int(((after[n] != start[n]) & (g != 0)).sum()) for n, g in grads.items())
    pushed = sum(int((g != 0).sum()) for g in grads.values())
    assert pushed > 0 and moved / pushed > 0.99, f"the step reached {moved} of {pushed} weights it pushed"
    for _ in range(4):
        _step(learner)
    now, master = learner.full_state_dict(), _weights(learner)
    assert {t.dtype for t in now.values() if t.is_floating_point()} == {torch.bfloat16}
    for name, weight in master.items():   # the engine gets the masters' rounding
        assert torch.equal(now[name], weight.bfloat16()), name
    if tied:
        assert torch.equal(now["lm_head.weight"], now["model.embed_tokens.weight"])
    assert any(not torch.equal(now[k], synced[k]) for k in synced), "5 steps left the bf16 weights unchanged"


@pytest.mark.unit
@pytest.mark.parametrize("overrides,message", [
    (["learner.pipeline.stages=2"], "torch pipeline learner"),
    (["learner.backend=deepspeed", "learner.zero_stage=0"], "ZeRO-0 without `learner.bf16: true`"),
])
def test_learners_without_a_float32_copy_of_bf16_weights_are_refused(overrides, message):
    from anytime.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=message):
        load_recipe(None, ["model.dtype=bfloat16", *overrides])
    load_recipe(None, ["model.dtype=float32", *overrides])   # float32 weights need no copy
    load_recipe(None, ["model.dtype=bfloat16", "learner.backend=deepspeed", "learner.zero_stage=0", "learner.bf16=true"])


@pytest.mark.unit
def test_deterministic_runs_give_cublas_its_fixed_workspace(monkeypatch):
    from anytime.trainer.trainer import use_deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on: None)
    use_deterministic_algorithms()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


# --- bf16 compute per device ----------------------------------------------------------------------

@pytest.fixture
def machine(monkeypatch):
    """Set whether the CPU (with its capability string) and the GPU have a native bf16 GEMM."""
    def set_probes(*, cpu_bf16: bool, capability: str = "AVX2", cuda: bool = False, cuda_bf16: bool = False,
                   local_rank: int = 0):
        path = "native" if cpu_bf16 else ("reference" if capability == "AVX2" else "converted")
        monkeypatch.setattr(precision, "cpu_bf16_path", lambda: path)
        monkeypatch.setattr(precision, "cpu_capability", lambda: capability)
        monkeypatch.setattr(precision, "cuda_native_bf16", lambda: cuda_bf16)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4 if cuda else 0)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: local_rank)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return set_probes


# --- the probes ------------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_cpu_probe_follows_torch_s_onednn_bf16_dispatch_and_the_bf16_instructions(monkeypatch):
    onednn = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    instructions = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert precision.cpu_bf16_path() == ("reference" if not onednn else "native" if instructions else "converted")
    assert precision.cpu_native_bf16() is (precision.cpu_bf16_path() == "native")
    # AVX-512 without AVX512_BF16 / AMX: oneDNN converts (~4x slower than float32), not native
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    if torch.backends.mkldnn.is_available():
        assert precision.cpu_bf16_path() == "converted" and precision.cpu_native_bf16() is False
        assert "~4x slower" in precision.slowdown("cpu")
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        assert precision.cpu_bf16_path() == "native"
    # the matmul dispatch takes oneDNN's bf16 GEMM only with oneDNN enabled: off, bf16 runs on the reference GEMM
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert precision.cpu_native_bf16() is False and precision.cpu_bf16_path() == "reference"
    assert "~34x slower" in precision.slowdown("cpu")
    assert isinstance(precision.cpu_capability(), str) and precision.cpu_capability()
    # the doctor names another machine's path; a GPU's cost is its emulation
    assert "~4x slower" in precision.slowdown("cpu", "converted") and precision.slowdown("cpu", "native") == \
        "no slower than float32"
    assert precision.slowdown("cuda", "reference") == "emulated, slower than float32"


@pytest.mark.unit
def test_the_device_type_picks_the_probe(machine):
    machine(cpu_bf16=False, cuda=True, cuda_bf16=True)
    assert precision.native_bf16("cuda") is True and precision.native_bf16("cpu") is False
    machine(cpu_bf16=True, cuda=True, cuda_bf16=False)
    assert precision.native_bf16("cuda") is False and precision.native_bf16("cpu") is True


# --- auto, true and false on either machine ---------------------------------------------------------

@pytest.mark.parametrize("requested, native, enabled", [
    ("auto", True, True), ("auto", False, False),
    (True, True, True),
    (False, True, False), (False, False, False),
])
@pytest.mark.unit
def test_learner_bf16_resolves_by_the_device_s_native_bf16(requested, native, enabled):
    choice = precision.resolve_bf16(requested, "cpu", native, where="this CPU (AVX2)")
    assert choice.enabled is enabled and choice.requested == requested


@pytest.mark.unit
def test_an_explicit_true_on_a_cpu_without_native_bf16_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(RecipeError) as refused:
        precision.resolve_bf16(True, "cpu", native=False, where="this CPU (AVX2)",
                               cost=precision.CPU_SLOWDOWN["reference"])
    message = str(refused.value)
    assert message.startswith("`learner.bf16: true` on this CPU (AVX2), which has no native bf16 GEMM")
    assert "~34x slower than float32" in message
    assert "Set learner.bf16=auto" in message and "learner.bf16=false" in message


@pytest.mark.unit
def test_an_explicit_true_on_a_gpu_that_only_emulates_bf16_is_kept_and_said(machine):
    choice = precision.resolve_bf16(True, "cuda", native=False)
    assert choice.enabled is True and "only emulates bf16" in choice.reason and "learner.bf16=auto" in choice.reason
    assert precision.resolve_bf16("auto", "cuda", native=False).enabled is False


@pytest.mark.unit
def test_auto_says_what_it_became_and_what_bf16_would_cost(machine):
    machine(cpu_bf16=False, capability="AVX2")
    fallback = precision.resolve_bf16("auto", "cpu", precision.native_bf16("cpu"))
    assert fallback.reason.startswith("learner.bf16: auto -> float32 on this CPU (AVX2): no native bf16 GEMM")
    assert "~34x slower" in fallback.reason and fallback.shown == "learner.bf16: auto -> fp32 here"
    machine(cpu_bf16=True, capability="AVX512")
    native = precision.resolve_bf16("auto", "cpu", precision.native_bf16("cpu"))
    assert native.reason == "learner.bf16: auto -> bf16 on this CPU (AVX512): its native bf16 GEMM"
    machine(cpu_bf16=False, capability="AVX512")   # AVX-512 without AVX512_BF16: oneDNN converts, ~4x slower
    converted = precision.resolve_bf16("auto", "cpu", precision.native_bf16("cpu"))
    assert converted.enabled is False and "~4x slower" in converted.reason


@pytest.mark.unit
def test_bf16_weights_on_a_cpu_without_native_bf16_get_a_warning():
    note = precision.low_precision_weights_note("bfloat16", "cpu", native=False, where="this CPU (AVX2)")
    assert note is not None and note.startswith("`model.dtype: bfloat16` on this CPU (AVX2)")
    assert note.endswith("set model.dtype=float32")
    assert precision.low_precision_weights_note("bfloat16", "cpu", native=True) is None
    assert precision.low_precision_weights_note("float32", "cpu", native=False) is None
    assert precision.low_precision_weights_note("bfloat16", "cuda", native=True) is None


# --- where the resolution is used ------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_the_factory_logs_one_line_and_refuses_true_at_the_run_s_start(machine, caplog, cpu_bf16):
    from anytime.learner.factory import learner_precision

    machine(cpu_bf16=cpu_bf16)
    recipe = load_recipe(QUICKSTART, ["learner.bf16=auto"])
    with caplog.at_level(logging.INFO, logger="anytime.learner.factory"):
        assert learner_precision(recipe, "cpu").enabled is cpu_bf16
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"learner.bf16: auto -> {'bf16' if cpu_bf16 else 'float32'} on this CPU (AVX2)")
    explicit = load_recipe(QUICKSTART, ["learner.bf16=true"])   # the recipe loads whatever the machine
    if cpu_bf16:
        assert learner_precision(explicit, "cpu").enabled
    else:
        with pytest.raises(RecipeError, match="learner.bf16"):
            learner_precision(explicit, "cpu")


@pytest.mark.unit
def test_a_gpu_recipe_loads_on_a_cpu_machine_and_is_refused_only_when_run_there(machine, caplog):
    from anytime.trainer.launch import check_precision_here

    paper = REPO / "recipes" / "paper" / "ar_uniform.yaml"
    machine(cpu_bf16=False)
    recipe = load_recipe(str(paper))   # `anytime config` of a paper recipe on a laptop
    assert recipe.learner.bf16 is True and recipe.model.dtype == "bfloat16"
    with pytest.raises(RecipeError, match="learner.bf16=auto"):
        check_precision_here(recipe)
    machine(cpu_bf16=False, cuda=True, cuda_bf16=True)   # the GPU machine it is meant for
    with caplog.at_level(logging.WARNING, logger="anytime.trainer.launch"):
        check_precision_here(recipe)
    assert caplog.records == []


@pytest.mark.unit
def test_bf16_weights_on_a_cpu_without_native_bf16_are_warned_at_the_run_s_start(machine, caplog):
    from anytime.trainer.launch import check_precision_here

    machine(cpu_bf16=False)
    with caplog.at_level(logging.WARNING, logger="anytime.trainer.launch"):
        check_precision_here(load_recipe(QUICKSTART, ["model.dtype=bfloat16", "learner.bf16=auto"]))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "`model.dtype: bfloat16`" in line and "model.dtype=float32" in line


@pytest.mark.unit
@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_the_torch_learner_autocasts_where_auto_resolves_to_bf16(machine, cpu_bf16):
    from anytime.learner.data_parallel import TorchLearner

    def learner(bf16):
        model = torch.nn.Linear(4, 4)   # float32 weights: autocast comes from `learner.bf16` alone
        model.config = None
        return TorchLearner(model, LearnerConfig(bf16=bf16, pack_summaries=False), total_steps=1)

    machine(cpu_bf16=cpu_bf16)
    assert learner("auto").autocast_dtype == (torch.bfloat16 if cpu_bf16 else None)
    assert learner(False).autocast_dtype is None


@pytest.mark.unit
@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_deepspeed_s_bf16_mode_follows_auto(machine, monkeypatch, cpu_bf16):
    from anytime.learner import deepspeed_learner

    machine(cpu_bf16=cpu_bf16)
    monkeypatch.setattr(deepspeed_learner, "cuda_available", lambda: False)
    config = deepspeed_learner.deepspeed_config(LearnerConfig(bf16="auto"), zero_stage=2)
    assert config["bf16"] == {"enabled": cpu_bf16}


@pytest.mark.unit
def test_zero0_with_bf16_weights_needs_an_explicit_true():
    # `auto` may become float32 on the run's device, where ZeRO-0 would keep no float32 copy of the weights
    with pytest.raises(RecipeError, match="ZeRO-0 without `learner.bf16: true`"):
        load_recipe(None, ["model.dtype=bfloat16", "learner.backend=deepspeed", "learner.zero_stage=0",
                           "learner.bf16=auto"])


# --- the supervised warm start ---------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("local_rank", [0, 3])
def test_the_warm_start_trains_on_the_learner_s_gpu_in_float32(machine, local_rank):
    """Round 6, finding 3: the warm start ran on the CPU also on a GPU machine, while the other ranks waited."""
    from anytime.trainer.sft import sft_placement

    machine(cpu_bf16=False, cuda=True, cuda_bf16=True, local_rank=local_rank)
    place = sft_placement(load_recipe(QUICKSTART, ["learner.bf16=auto"]))
    assert place.device == torch.device("cuda", local_rank) and place.dtype == torch.float32
    assert sft_placement(load_recipe(QUICKSTART, ["model.dtype=float64"])).dtype == torch.float64


@pytest.mark.unit
@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_without_a_gpu_the_warm_start_trains_on_the_cpu(machine, cpu_bf16):
    from anytime.trainer.sft import sft_placement

    machine(cpu_bf16=cpu_bf16)
    place = sft_placement(load_recipe(QUICKSTART, ["learner.bf16=auto"]))
    assert place.device == torch.device("cpu") and place.dtype == torch.float32


# --- the recipes -----------------------------------------------------------------------------------

@pytest.mark.unit
def test_recipes_outside_the_paper_s_gpu_runs_ask_for_bf16_by_the_device():
    """CPU recipes leave bf16 to the machine (`auto`); only recipes/paper (GPU runs) set it to true."""
    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        if "paper" in path.parts:
            continue
        recipe = load_recipe(str(path))
        assert recipe.learner.bf16 is not True, f"{path.relative_to(REPO)}: set learner.bf16: auto"
