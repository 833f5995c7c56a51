"""Whether a device multiplies bf16 natively, and the precision `learner.bf16` resolves to there.

bf16 pays only where the device has bf16 arithmetic: a CUDA GPU with bf16 support (Ampere and later),
or a CPU with bf16 instructions (AVX512_BF16 or AMX on x86, BF16 on ARM). A CPU without them takes one
of two slower paths, both measured with torch 2.13 (`benchmarks/precision.py`):
  converted  AVX-512 without AVX512_BF16 (many Xeons): oneDNN still runs bf16 matmuls, converting to
             float32 inside; SmolLM2-135M's forward + backward (8 x 128 tokens) under bf16 autocast
             took 15.8 s against 3.8 s in float32, about 4x slower;
  reference  AVX2 only (many laptops, AMD EPYC before Zen 4): torch's reference GEMM; a 1024x576 @
             576x1536 bf16 matmul took 1609 ms against 47.6 ms in float32, about 34x slower.
So `learner.bf16: auto` means bf16 where it is native and float32 elsewhere (said in one line), and
an explicit `true` on a CPU without it is refused at the run's start (`resolve_bf16`), where the
learner's device is known: a recipe for a GPU run still loads on a CPU machine.

The probes are plain functions of this module (tests replace them); callers pass what they saw to
`resolve_bf16`, so `anytime doctor` and the run decide alike from the same facts.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from anytime.errors import RecipeError

AUTO = "auto"
# what bf16 costs on a CPU without bf16 instructions, by the path torch takes there (module doc)
CPU_SLOWDOWN = {
    "converted": "~4x slower than float32 (SmolLM2-135M forward + backward: 15.8 s bf16 vs 3.8 s float32 on an "
                 "AVX-512 Xeon without AVX512_BF16)",
    "reference": "~34x slower than float32 (1024x576 @ 576x1536: 1609 ms bf16 vs 47.6 ms float32 on an AVX2 EPYC)",
}


# --- probes ----------------------------------------------------------------------------------------

def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels use here ("AVX2", "AVX512", "DEFAULT", ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_bf16_path() -> str:
    """How torch multiplies bf16 on this CPU: "native" (oneDNN on bf16 instructions), "converted"
    (oneDNN on AVX-512 without them) or "reference" (torch's own GEMM: no oneDNN bf16 here, or
    oneDNN switched off), following the check torch's CPU matmul dispatch makes
    (`mkldnn_bf16_device_check`) and then the instructions oneDNN finds."""
    mkldnn = torch.backends.mkldnn
    try:
        onednn = mkldnn.is_available() and mkldnn.enabled and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):   # a build without the op
        onednn = False
    if not onednn:
        return "reference"
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "native"   # ARM: torch's check already asks for the BF16 extension
    x86_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "native" if x86_bf16 else "converted"


def cpu_native_bf16() -> bool:
    """Whether this CPU has bf16 instructions that torch's matmuls use (`cpu_bf16_path`)."""
    return cpu_bf16_path() == "native"


def cuda_native_bf16() -> bool:
    """Whether the current CUDA device has bf16 tensor cores (compute capability 8.0+); older GPUs
    only emulate bf16, which torch's `is_bf16_supported()` counts unless told not to."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` ("cuda" or "cpu") has a native bf16 GEMM."""
    return cuda_native_bf16() if device_type == "cuda" else cpu_native_bf16()


def device_words(device_type: str) -> str:
    """The device in a log line: "this GPU" / "this CPU (AVX2)"."""
    return "this GPU" if device_type == "cuda" else f"this CPU ({cpu_capability()})"


# --- resolution ------------------------------------------------------------------------------------

def bf16_enabled(requested: bool | str, native: bool) -> bool:
    """`learner.bf16` as a bool: `auto` is `native`; true and false are themselves."""
    return native if requested == AUTO else bool(requested)


@dataclass(frozen=True)
class Bf16Choice:
    requested: bool | str   # `learner.bf16` as written: true, false or "auto"
    enabled: bool           # bf16 used: the torch learner's autocast, DeepSpeed's bf16 mode, the warm start's autocast
    reason: str             # one line: what was chosen on which device, and why

    @property
    def shown(self) -> str:
        """`learner.bf16: auto -> fp32 here`: the setting as written and what it became."""
        written = self.requested if isinstance(self.requested, str) else str(self.requested).lower()
        return f"learner.bf16: {written} -> {'bf16' if self.enabled else 'fp32'} here"


def resolve_bf16(requested: bool | str, device_type: str, native: bool, where: str | None = None,
                 cost: str | None = None) -> Bf16Choice:
    """What `learner.bf16` means on `device_type`, given whether it has a native bf16 GEMM (`native`,
    from `native_bf16` or the doctor's probe); `where` names the device and `cost` what bf16 costs
    there (default: this machine's, `slowdown`) in the reason. An explicit
    true on a CPU without one is a `RecipeError` that says what to set; on an older GPU (emulated
    bf16) it is kept, and the reason says it is emulated."""
    where = where or device_words(device_type)
    cost = cost or slowdown(device_type)
    enabled = bf16_enabled(requested, native)
    if requested is True and not native and device_type != "cuda":
        raise RecipeError(f"`learner.bf16: true` on {where}, which has no native bf16 GEMM: torch runs bf16 "
                          f"matmuls {cost}. Set learner.bf16=auto (bf16 where it is "
                          "native, float32 here) or learner.bf16=false")
    if requested == AUTO:
        why = "its native bf16 GEMM" if native else f"no native bf16 GEMM (bf16 would run {cost})"
        return Bf16Choice(requested, enabled, f"learner.bf16: auto -> {'bf16' if enabled else 'float32'} on {where}: "
                                              f"{why}")
    if enabled and not native:
        return Bf16Choice(requested, True, f"learner.bf16: true on {where}, which only emulates bf16 (compute "
                                           "capability < 8.0): slower than float32; set learner.bf16=auto for float32")
    return Bf16Choice(requested, enabled, f"learner.bf16: {str(requested).lower()} on {where}")


def slowdown(device_type: str, cpu_path: str | None = None) -> str:
    """What bf16 costs on `device_type` when it is not native there, in words: on a CPU by the path torch
    takes there (`cpu_path`, default this machine's `cpu_bf16_path()`; `CPU_SLOWDOWN`)."""
    if device_type == "cuda":
        return "emulated, slower than float32"
    return CPU_SLOWDOWN.get(cpu_path or cpu_bf16_path(), "no slower than float32")


def low_precision_weights_note(dtype: str, device_type: str, native: bool, where: str | None = None,
                               cost: str | None = None) -> str | None:
    """A warning for `model.dtype: bfloat16` on a CPU without a native bf16 GEMM (the learner's forward
    runs under bf16 autocast and a transformers engine generates in bf16 there), else None."""
    if dtype != "bfloat16" or native or device_type == "cuda":
        return None
    where = where or device_words(device_type)
    return (f"`model.dtype: bfloat16` on {where}, which has no native bf16 GEMM: the learner's forward passes and "
            f"a transformers engine's generation run bf16 matmuls {cost or slowdown(device_type)}; set model.dtype=float32")
