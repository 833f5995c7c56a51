"""Weights for a rollout engine in another process: files in RAM (/dev/shm) that the engine reads and the
sender deletes (a safetensors file, or the shared buffer of the CPU IPC weight transfer), named with the
sender's pid, and the clean-up of files left by a sender that was killed."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch

_SHM = "/dev/shm"
_WEIGHTS_PREFIX = "anytime-weights-"


def write_weights(updates: list[tuple[str, torch.Tensor]]) -> str:
    """Write weights to a fresh safetensors file for the engine process, in RAM (/dev/shm) when it
    has room; the caller deletes it. Tensors that share storage with an earlier one (tied embeddings)
    are copied, since safetensors refuses shared storage."""
    from safetensors.torch import save_file

    storages: set[int] = set()
    tensors = {}
    for name, t in updates:
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    where = _SHM if os.path.isdir(_SHM) and shutil.disk_usage(_SHM).free > 2 * size else None
    fd, path = tempfile.mkstemp(prefix=f"{_WEIGHTS_PREFIX}{os.getpid()}-", suffix=".safetensors", dir=where)
    os.close(fd)
    try:
        save_file(tensors, path)
    except BaseException:
        os.unlink(path)
        raise
    return path


def weight_file_path(name: str) -> str:
    """A path for a weight file of this process named `name` (not created), in RAM when /dev/shm exists:
    `weight_file_globs` and `remove_orphaned_weight_files` find it by the pid in its name."""
    where = _SHM if os.path.isdir(_SHM) else tempfile.gettempdir()
    return os.path.join(where, f"{_WEIGHTS_PREFIX}{os.getpid()}-{name}")


def _weight_folders() -> tuple[str, str]:
    """Where `write_weights` may put its files: RAM, else the temp dir (mkstemp's default)."""
    return _SHM, tempfile.gettempdir()


def weight_file_globs(pid: int) -> list[str]:
    """The files `write_weights` in process `pid` may leave, as globs (for its watchdog)."""
    return [os.path.join(folder, f"{_WEIGHTS_PREFIX}{pid}-*") for folder in _weight_folders()]


def remove_orphaned_weight_files(folders: Iterable[str] | None = None) -> None:
    """Delete weight files left by a process that was killed mid-sync (its pid is in the name)."""
    import psutil  # a vLLM dependency

    for folder in set(folders or _weight_folders()):
        for path in glob.glob(os.path.join(folder, f"{_WEIGHTS_PREFIX}*")):
            pid = os.path.basename(path)[len(_WEIGHTS_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def write_adapter(factors: Iterable[tuple[str, torch.Tensor, torch.Tensor, float]], base_model: str) -> str:
    """LoRA factors (Hugging Face weight name, A [r, in], B [out, r], scaling) as a PEFT adapter folder
    (adapter_config.json + adapter_model.safetensors) in a fresh temporary folder; the caller deletes
    it. The adapter is small, so it goes to the temp dir, not to RAM."""
    import json

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    rank, alpha = 0, 0.0
    for name, a, b, scaling in factors:
        module = name.removesuffix(".weight")
        targets.add(module.rsplit(".", 1)[-1])
        rank, alpha = a.shape[0], scaling * a.shape[0]
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().to("cpu").contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    folder = tempfile.mkdtemp(prefix=f"anytime-adapter-{os.getpid()}-")
    try:
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "bias": "none",
                  "target_modules": sorted(targets), "base_model_name_or_path": base_model, "lora_dropout": 0.0,
                  "fan_in_fan_out": False, "modules_to_save": None}
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder
