"""Which Adam the DeepSpeed learner asks DeepSpeed for: its FusedAdam (a CUDA op, prebuilt or JIT-built
with nvcc of torch's CUDA major version and ninja) only where it can be loaded, else torch's AdamW. The
machines are made by replacing the learner module's own probes; DeepSpeed itself is not started, nor
nvcc or ninja."""

from __future__ import annotations

import logging

import pytest

from anytime.config import LearnerConfig
from anytime.learner import deepspeed_learner

NVCC = "/usr/local/cuda/bin/nvcc"


@pytest.fixture
def machine(monkeypatch):
    """Set what the learner's probes report: a CUDA device, DeepSpeed's prebuilt op, a CUDA toolkit
    (`nvcc --version`'s text), torch's CUDA build and ninja on PATH."""
    def set_probes(*, cuda: bool, prebuilt: bool = False, nvcc: str | None = None, release: str = "12.8",
                   torch_cuda: str | None = "12.8", ninja: bool = True):
        monkeypatch.setattr(deepspeed_learner, "cuda_available", lambda: cuda)
        monkeypatch.setattr(deepspeed_learner, "fused_adam_prebuilt", lambda: prebuilt)
        monkeypatch.setattr(deepspeed_learner, "cuda_toolkit", lambda: nvcc)
        monkeypatch.setattr(deepspeed_learner, "nvcc_version_text", lambda path: nvcc_says(release))
        monkeypatch.setattr(deepspeed_learner.torch.version, "cuda", torch_cuda)
        monkeypatch.setattr(deepspeed_learner, "ninja_available", lambda: ninja)
    return set_probes


def nvcc_says(release: str) -> str:
    """What `nvcc --version` prints for a toolkit of `release`."""
    return ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2024 NVIDIA Corporation\n"
            f"Cuda compilation tools, release {release}, V{release}.131\nBuild cuda_{release}.r{release}/compiler.0\n")


def torch_adam(caplog) -> bool:
    with caplog.at_level(logging.DEBUG, logger=deepspeed_learner.__name__):
        config = deepspeed_learner.deepspeed_config(LearnerConfig(), zero_stage=2)
    return config["optimizer"]["params"]["torch_adam"]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.unit
def test_cuda_without_a_toolkit_uses_torch_adamw_and_says_why(machine, caplog):
    machine(cuda=True, prebuilt=False, nvcc=None)
    assert torch_adam(caplog) is True
    assert warnings(caplog) == ["DeepSpeed's FusedAdam needs a CUDA toolkit (nvcc / CUDA_HOME) to build: "
                                "using torch's AdamW"]


@pytest.mark.unit
def test_cuda_with_a_toolkit_uses_fused_adam_silently(machine, caplog):
    machine(cuda=True, prebuilt=False, nvcc=NVCC)
    assert torch_adam(caplog) is False
    assert warnings(caplog) == []


@pytest.mark.unit
def test_a_prebuilt_fused_adam_needs_no_toolkit(machine, caplog):
    machine(cuda=True, prebuilt=True, nvcc=None)
    assert torch_adam(caplog) is False
    assert warnings(caplog) == []


@pytest.mark.unit
def test_the_cpu_uses_torch_adamw_without_probing_for_cuda_ops(machine, caplog, monkeypatch):
    machine(cuda=False)
    def must_not_probe():
        raise AssertionError("probed for a CUDA op on a machine without CUDA")
    monkeypatch.setattr(deepspeed_learner, "fused_adam_prebuilt", must_not_probe)
    monkeypatch.setattr(deepspeed_learner, "cuda_toolkit", must_not_probe)
    assert torch_adam(caplog) is True
    assert warnings(caplog) == []


@pytest.mark.unit
def test_an_optimizer_of_our_own_leaves_deepspeed_none_to_choose(machine):
    machine(cuda=True, nvcc=None)
    config = deepspeed_learner.deepspeed_config(LearnerConfig(), zero_stage=2, own_optimizer=True)
    assert "optimizer" not in config


@pytest.mark.unit
def test_the_toolkit_release_is_read_from_nvcc_version(monkeypatch):
    monkeypatch.setattr(deepspeed_learner, "nvcc_version_text", lambda path: nvcc_says("12.4"))
    assert deepspeed_learner.nvcc_cuda_release(NVCC) == "12.4"
    monkeypatch.setattr(deepspeed_learner, "nvcc_version_text", lambda path: "")   # nvcc did not run
    assert deepspeed_learner.nvcc_cuda_release(NVCC) is None


@pytest.mark.unit
@pytest.mark.parametrize("release, torch_cuda", [("11.8", "12.8"), ("13.0", "12.8"), ("12.4", None)])
def test_a_toolkit_of_another_cuda_major_than_torch_uses_torch_adamw_and_says_why(machine, caplog, release,
                                                                                   torch_cuda):
    machine(cuda=True, nvcc=NVCC, release=release, torch_cuda=torch_cuda)
    assert torch_adam(caplog) is True
    (line,) = warnings(caplog)
    assert f"CUDA {release} ({NVCC})" in line and f"torch built for CUDA {torch_cuda}" in line
    assert "major-version mismatch" in line and line.endswith("using torch's AdamW")


@pytest.mark.unit
def test_a_toolkit_of_torch_s_major_with_another_minor_builds_fused_adam(machine, caplog):
    machine(cuda=True, nvcc=NVCC, release="12.4", torch_cuda="12.8")   # torch's builder only warns on a minor one
    assert torch_adam(caplog) is False
    assert warnings(caplog) == []


@pytest.mark.unit
def test_an_unreadable_nvcc_version_uses_torch_adamw(machine, caplog, monkeypatch):
    machine(cuda=True, nvcc=NVCC)
    monkeypatch.setattr(deepspeed_learner, "nvcc_version_text", lambda path: "")
    assert torch_adam(caplog) is True
    assert warnings(caplog) == [f"DeepSpeed's FusedAdam: the CUDA version of {NVCC} cannot be read (`nvcc --version`): "
                                "using torch's AdamW"]


@pytest.mark.unit
def test_without_ninja_on_path_uses_torch_adamw_and_says_why(machine, caplog):
    machine(cuda=True, nvcc=NVCC, ninja=False)
    assert torch_adam(caplog) is True
    assert warnings(caplog) == [deepspeed_learner.NO_NINJA]
    adam = deepspeed_learner.choose_adam(True, deepspeed_learner.learner_probes())
    assert "pip install ninja" in adam.fix and "PATH" in adam.fix


@pytest.mark.unit
def test_a_prebuilt_op_is_not_asked_about_nvcc_or_ninja(machine, caplog):
    machine(cuda=True, prebuilt=True, nvcc=NVCC, release="11.8", ninja=False)
    assert torch_adam(caplog) is False
