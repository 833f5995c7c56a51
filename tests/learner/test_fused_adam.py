"""Which Adam the DeepSpeed learner asks DeepSpeed for: its FusedAdam (a CUDA op, prebuilt or JIT-built
with nvcc) only where it can be loaded, else torch's AdamW. The machines are made by replacing the
learner module's own probes; DeepSpeed itself is not started."""

from __future__ import annotations

import logging

import pytest

from anytime.config import LearnerConfig
from anytime.learner import deepspeed_learner

NVCC = "/usr/local/cuda/bin/nvcc"


@pytest.fixture
def machine(monkeypatch):
    """Set what the learner's probes report: a CUDA device, DeepSpeed's prebuilt op, a CUDA toolkit."""
    def set_probes(*, cuda: bool, prebuilt: bool = False, nvcc: str | None = None):
        monkeypatch.setattr(deepspeed_learner, "cuda_available", lambda: cuda)
        monkeypatch.setattr(deepspeed_learner, "fused_adam_prebuilt", lambda: prebuilt)
        monkeypatch.setattr(deepspeed_learner, "cuda_toolkit", lambda: nvcc)
    return set_probes


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
