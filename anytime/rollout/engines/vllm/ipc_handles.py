"""The handles of the IPC weight transfer, per device: what the learner exports so that an engine core in
another process on the same machine maps the learner's weights instead of receiving their bytes.

- CUDA: torch's own CUDA IPC handle of each tensor (`reduce_tensor`), keyed by the GPU's UUID; vLLM's `ipc`
  weight-transfer backend rebuilds it.
- CPU: the tensors copied once into one shared-memory file (/dev/shm), each handle the file's path, the
  tensor's byte offset and size, keyed by this machine's boot id; the CPU twin of vLLM's backend
  (`anytime.rollout.engines.vllm.cpu_ipc`) maps the file.

Only the handle differs: both travel pickled in the update info (`IpcWeightLoader`), both stay the sender's
memory until the engine has finished the update, and a receiver on another machine (another GPU) finds no
handle under its own key and says so. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence

import torch

from anytime.rollout.engines.weight_files import weight_file_path

_ALIGN = 64   # each tensor starts on a cache line, so a view of any dtype is aligned


def host_key() -> str:
    """This machine, as a CPU handle's key: its boot id (a fresh one at every boot), else its host name."""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"host-{f.read().strip()}"
    return f"host-{os.uname().nodename}"


def gpu_key(device: torch.device) -> str:
    """A GPU, as vLLM's IPC receiver looks it up: the UUID of the physical device."""
    return str(torch.cuda.get_device_properties(device).uuid)


@contextlib.contextmanager
def exported(weights: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> Iterator[list[dict[str, tuple]]]:
    """One handle per weight, in order, for the block's duration: the memory they name is kept until the
    block ends (the receiver maps it, it does not copy it first), then released."""
    if device.type == "cuda":
        with _cuda_exported(weights, device) as handles:
            yield handles
    else:
        with _cpu_exported(weights) as handles:
            yield handles


@contextlib.contextmanager
def _cuda_exported(weights: Sequence[tuple[str, torch.Tensor]], device: torch.device
                   ) -> Iterator[list[dict[str, tuple]]]:
    from torch.multiprocessing.reductions import reduce_tensor

    shared = [t.detach().to(device).contiguous() for _, t in weights]
    try:
        yield [{gpu_key(t.device): reduce_tensor(t)[1]} for t in shared]
    finally:
        del shared
        torch.cuda.ipc_collect()   # the engine's mappings are gone: free what only they held


@contextlib.contextmanager
def _cpu_exported(weights: Sequence[tuple[str, torch.Tensor]]) -> Iterator[list[dict[str, tuple]]]:
    offsets, end = [], 0
    for _, t in weights:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    path = weight_file_path(f"{uuid.uuid4().hex}.ipc")
    try:
        buffer = torch.from_file(path, shared=True, size=max(end, 1), dtype=torch.uint8)
        for (_, t), offset in zip(weights, offsets):
            _view(buffer, offset, t.dtype, t.shape).copy_(t.detach())
        del buffer
        key = host_key()
        yield [{key: (path, offset, t.numel() * t.element_size())} for (_, t), offset in zip(weights, offsets)]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def rebuilt_on_cpu(handles: Sequence[dict[str, tuple]], dtype_names: Sequence[str],
                   shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The receiver's side of a CPU export: each weight as a read-only-by-contract view of the sender's
    shared file (mapped privately: a write here would never reach the sender)."""
    key, maps, out = host_key(), {}, []
    for handle, dtype, shape in zip(handles, dtype_names, shapes):
        if key not in handle:
            raise ValueError(f"IPC handle not found for this machine ({key}); the handles name {list(handle)}: "
                             "the CPU IPC weight transfer needs the learner and the engine on one machine")
        path, offset, _ = handle[key]
        if path not in maps:
            maps[path] = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        out.append(_view(maps[path], offset, getattr(torch, dtype), tuple(shape)))
    return out


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))
