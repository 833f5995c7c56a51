"""The DeepSpeed learner: the data-parallel micro-batch loop on a DeepSpeed ZeRO 0-3 engine (gloo
and torch's AdamW on the CPU, so nothing is JIT-compiled there; on CUDA, DeepSpeed's FusedAdam where
it can be loaded, see `choose_adam`). DeepSpeed clips, skips steps with
non-finite gradients, steps the LR schedule and writes its own sharded checkpoint.

The helpers here (`initialize_engine`, `EngineStep`) also serve the pipelined DeepSpeed learner
(`anytime.learner.deepspeed_pipeline`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from anytime.core.dist import is_main
from anytime.core.precision import bf16_enabled, native_bf16
from anytime.learner.base import StepResult
from anytime.learner.data_parallel import DataParallelLearner
from anytime.learner.lr_schedules import lr_lambda

if TYPE_CHECKING:
    from anytime.config import LearnerConfig

CHECKPOINT_TAG = "deepspeed"
log = logging.getLogger(__name__)


def _init_single_process() -> None:
    """A single process not started by a launcher joins a world of one on a free port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _without_shared_memory_op() -> None:
    """On the CPU, DeepSpeed's comm backend JIT-builds a shared-memory all-reduce op when it starts
    (about 130 s on a cold machine) and leaves `/dev/shm/deepspeed_allreduce_buffer_*` files behind.
    That op serves only `inference_all_reduce` (tensor-parallel inference); training collectives go
    through torch.distributed (gloo) either way. DeepSpeed builds it only if its op-compatibility
    table, a dict it keeps in `deepspeed.ops` so that entries set there persist, lists it as
    available: marking it unavailable there before DeepSpeed's backend starts skips the build."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def fused_adam_prebuilt() -> bool:
    """Whether this DeepSpeed was installed with its FusedAdam op compiled for CUDA
    (`DS_BUILD_FUSED_ADAM=1`); the PyPI wheel ships none. DeepSpeed's `OpBuilder.load` imports the
    prebuilt op only when `installed_ops` lists it for the accelerator in use, else JIT-builds it."""
    try:
        from deepspeed.git_version_info import accelerator_name, installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get("fused_adam")) and accelerator_name == "cuda"


def cuda_toolkit() -> str | None:
    """The nvcc DeepSpeed would JIT-build its CUDA ops with, or None. The build goes through
    `torch.utils.cpp_extension.load`, which compiles with `CUDA_HOME/bin/nvcc` (torch finds CUDA_HOME
    from $CUDA_HOME, nvcc on $PATH or /usr/local/cuda, which may be a runtime without nvcc)."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    return nvcc if nvcc and os.access(nvcc, os.X_OK) else None


def nvcc_version_text(nvcc: str) -> str:
    """What `nvcc --version` prints ("" when it cannot be run)."""
    import subprocess

    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def nvcc_cuda_release(nvcc: str) -> str | None:
    """The CUDA release of the toolkit `nvcc` belongs to ("12.4" from "Cuda compilation tools, release 12.4,
    V12.4.131"), or None when it cannot be read."""
    import re

    found = re.search(r"release (\d+)\.(\d+)", nvcc_version_text(nvcc))
    return f"{found[1]}.{found[2]}" if found else None


def torch_cuda_version() -> str | None:
    """The CUDA release torch was built for ("12.8"; None for a CPU build)."""
    return torch.version.cuda


def ninja_available() -> bool:
    """Whether `ninja` runs from PATH: torch's extension builder (`cpp_extension.load`, which DeepSpeed's JIT
    build goes through) refuses to build without it, and looks for it on PATH, not in the Python package."""
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available()


@dataclass(frozen=True)
class AdamProbes:
    """What `choose_adam` asks about the machine, each called only as far as needed (tests and
    `anytime doctor` give their own)."""
    prebuilt: Callable[[], bool]                  # `fused_adam_prebuilt`
    toolkit: Callable[[], str | None]             # `cuda_toolkit`: the nvcc path
    toolkit_cuda: Callable[[str], str | None]     # `nvcc_cuda_release` of that nvcc
    torch_cuda: Callable[[], str | None]          # `torch_cuda_version`
    ninja: Callable[[], bool]                     # `ninja_available`


def learner_probes() -> AdamProbes:
    """This module's probes, looked up when called (so a test's replacement of one is seen)."""
    return AdamProbes(fused_adam_prebuilt, cuda_toolkit, nvcc_cuda_release, torch_cuda_version, ninja_available)


@dataclass(frozen=True)
class AdamChoice:
    fused: bool   # DeepSpeed's FusedAdam; False: torch's AdamW (DeepSpeed's `torch_adam`)
    reason: str
    fix: str = ""   # what gets FusedAdam built, when it is not


NO_CUDA_TOOLKIT = "DeepSpeed's FusedAdam needs a CUDA toolkit (nvcc / CUDA_HOME) to build: using torch's AdamW"
NO_NINJA = "DeepSpeed's FusedAdam builds with ninja, which is not on PATH: using torch's AdamW"


def choose_adam(cuda: bool, probes: AdamProbes) -> AdamChoice:
    """FusedAdam where DeepSpeed can load it: on CUDA, prebuilt, or JIT-built by torch's extension
    builder with nvcc and ninja. DeepSpeed itself cannot tell: `FusedAdamBuilder.is_compatible()`
    answers True without looking for nvcc, so `FusedAdam()` fails in its JIT build, also when nvcc's
    CUDA major version differs from torch's (torch's builder refuses that mismatch; a minor one it allows)."""
    if not cuda:
        return AdamChoice(False, "no CUDA device: using torch's AdamW")
    if probes.prebuilt():
        return AdamChoice(True, "DeepSpeed's FusedAdam, prebuilt with DeepSpeed")
    nvcc = probes.toolkit()
    torch_cuda = probes.torch_cuda()
    toolkit_fix = f"install the CUDA {torch_cuda} toolkit (nvcc) and set CUDA_HOME to it"
    if not nvcc:
        return AdamChoice(False, NO_CUDA_TOOLKIT, toolkit_fix)
    release = probes.toolkit_cuda(nvcc)
    if release is None:
        return AdamChoice(False, f"DeepSpeed's FusedAdam: the CUDA version of {nvcc} cannot be read "
                                 "(`nvcc --version`): using torch's AdamW", toolkit_fix)
    if torch_cuda is None or release.split(".")[0] != torch_cuda.split(".")[0]:
        return AdamChoice(False, f"DeepSpeed's FusedAdam would be built with CUDA {release} ({nvcc}) for a torch built "
                                 f"for CUDA {torch_cuda}: the build fails on the major-version mismatch; using torch's "
                                 "AdamW", toolkit_fix)
    if not probes.ninja():
        return AdamChoice(False, NO_NINJA, "pip install ninja, and run with its bin folder on PATH (the "
                                           "virtualenv's bin when it is installed there)")
    return AdamChoice(True, f"DeepSpeed's FusedAdam, built on first use with {nvcc} (CUDA {release}; torch's "
                            f"{torch_cuda}) and ninja")


def deepspeed_config(cfg: LearnerConfig, *, zero_stage: int, grad_clip: float | None = None,
                     own_optimizer: bool = False) -> dict[str, Any]:
    """DeepSpeed's config for `initialize_engine`; `own_optimizer`: the caller passes its optimizer."""
    cuda = cuda_available()
    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip if grad_clip is None else grad_clip,
        "gradient_allreduce_op": "sum" if zero_stage < 3 else "mean",
        "zero_optimization": {"stage": zero_stage},
        # `learner.bf16: auto` resolved for the engine's device (the learner factory said why)
        "bf16": {"enabled": bf16_enabled(cfg.bf16, native_bf16("cuda" if cuda else "cpu"))},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if own_optimizer:
        return ds_config
    adam = choose_adam(cuda, learner_probes())
    if is_main():
        log.log(logging.WARNING if cuda and not adam.fused else logging.DEBUG, adam.reason)
    ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": cfg.lr, "betas": list(cfg.betas),
                                                          "weight_decay": cfg.weight_decay,
                                                          "torch_adam": not adam.fused}}
    return ds_config


def initialize_engine(module: torch.nn.Module, params: Iterable[torch.nn.Parameter], cfg: LearnerConfig,
                      total_steps: int, *, zero_stage: int, mpu: Any = None,
                      optimizer: torch.optim.Optimizer | None = None,
                      grad_clip: float | None = None) -> tuple[Any, Any, Any]:
    """(engine, optimizer, LR scheduler) of a DeepSpeed ZeRO engine over `module`'s `params`.

    Each data-parallel rank's loss is its share of the mini-batch loss (the normaliser is global),
    so the engine *sums* the ranks' gradients (`gradient_allreduce_op: sum`); DeepSpeed does not
    offer that under ZeRO-3, where `loss_multiplier` returns the factor to scale the loss by instead.
    `optimizer` replaces DeepSpeed's own AdamW (ZeRO then runs it on its fp32 partitions), and
    `grad_clip` the recipe's clipping threshold (0 = DeepSpeed does not clip).
    """
    import deepspeed

    _without_shared_memory_op()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            _init_single_process()
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    ds_config = deepspeed_config(cfg, zero_stage=zero_stage, grad_clip=grad_clip,
                                 own_optimizer=optimizer is not None)
    schedule = lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps)
    # DeepSpeed builds the scheduler on its base optimizer, steps it and checkpoints it itself.
    engine, ds_optimizer, _, scheduler = deepspeed.initialize(
        model=module, model_parameters=list(params), config=ds_config, mpu=mpu, optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    return engine, ds_optimizer, scheduler


def loss_multiplier(zero_stage: int, dp_size: int) -> float:
    """What the loss is scaled by before DeepSpeed's backward so that its reduction sums the
    data-parallel shares: 1 where the engine sums, `dp_size` under ZeRO-3, where it averages."""
    return float(dp_size) if zero_stage >= 3 else 1.0


class EngineStep:
    """`engine.step()` as a `StepResult`: the global norm DeepSpeed clipped by and whether its
    overflow check skipped the step (decided over the data-parallel and model-parallel groups, so
    the same on every rank)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._skipped_seen = engine.skipped_steps

    def __call__(self) -> StepResult:
        lr = self.engine.optimizer.param_groups[0]["lr"]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        skipped = self.engine.skipped_steps > self._skipped_seen
        self._skipped_seen = self.engine.skipped_steps
        return StepResult(norm, skipped or not math.isfinite(norm), lr)


class DeepSpeedLearner(DataParallelLearner):
    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_steps: int,
                 ref_model: torch.nn.Module | None = None, peft_model: Any = None):
        # with LoRA only the adapter trains: ZeRO partitions and steps the adapter alone
        self.engine, self.optimizer, self.scheduler = initialize_engine(
            model, [p for p in model.parameters() if p.requires_grad], cfg, total_steps, zero_stage=cfg.zero_stage)
        super().__init__(self.engine.module, cfg, ref_model, peft_model)
        self._zero3 = cfg.zero_stage == 3
        self._loss_multiplier = loss_multiplier(cfg.zero_stage, self.dp_size)
        self._step = EngineStep(self.engine)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        # ZeRO reduces gradients in the backward of the accumulation boundary: mark the last micro-batch.
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self._loss_multiplier if self._loss_multiplier != 1.0 else loss,
                             scale_wrt_gas=False)

    def optimizer_step(self) -> StepResult:
        return self._step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    @contextlib.contextmanager
    def _gathered(self) -> Iterator[None]:
        if self._zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        if self.peft_model is not None:  # ZeRO 0-2 (config.validate): every rank holds the weights
            return super().full_state_dict(all_ranks)
        with self._gathered():  # ZeRO-3 gathers on every rank
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, folder: Path) -> None:
        self._save_adapter(folder)
        # with LoRA, DeepSpeed's module file holds the adapter alone (the frozen base is not saved)
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=False,
                                    exclude_frozen_parameters=self.peft_model is not None)

    def load(self, folder: Path) -> None:
        from anytime.learner.checkpoint import check_deepspeed_files

        check_deepspeed_files(folder / CHECKPOINT_TAG)  # DeepSpeed's own loader unpickles them
        self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=False)
        if self.peft_model is not None:
            self._load_model(folder)
