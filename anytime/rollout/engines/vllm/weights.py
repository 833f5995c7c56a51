"""The worker side of weight sync with vLLM: methods mixed into vLLM's worker (reached through
``collective_rpc``), learner rank 0's end of the NCCL weight group (GPU only), and the sender of vLLM's IPC
weight-transfer engine for an engine core in a process of its own (CUDA IPC, or its CPU twin)."""

from __future__ import annotations

import base64
import contextlib
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class AnytimeWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``); they run where the model lives,
    in this process or in the engine's own process, and are reached by name through ``collective_rpc``."""

    def anytime_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named weights handed over by reference (an engine in this process; one of its
        own takes them through vLLM's weight transfer, `IpcWeightLoader`)."""
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]

    def anytime_init_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join a NCCL group with learner rank 0 (its rank 0) for weight broadcasts (GPU only); a broadcast
        that has not arrived after `timeout_s` fails the receive."""
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        self._anytime_nccl = nccl_communicator(group, self.device)  # type: ignore[attr-defined]
        self._anytime_nccl_timeout_s = timeout_s

    def anytime_receive_weights(self, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
        """Receive every weight of `layout` (name, shape, dtype) by broadcast from learner rank 0 and load
        it as it arrives: one received weight on the GPU at a time, not a second copy of the model."""
        device, comm = self.device, self._anytime_nccl  # type: ignore[attr-defined]

        def receive(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            return tensor   # the load that copies it runs on the same stream, after the broadcast

        with contextlib.closing(received_one_at_a_time(layout, receive)) as weights:
            self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        wait_for(stream_done(torch.cuda.current_stream()), self._anytime_nccl_timeout_s,  # type: ignore[attr-defined]
                 "receiving the weights over NCCL")


def nccl_communicator(group: Any, device: Any) -> Any:
    """vLLM's `PyNcclCommunicator` on `group`, refused where vLLM disabled it: it does so silently when
    libnccl cannot be loaded (or VLLM_DISABLE_PYNCCL is set, or the group has one member), and then every
    `broadcast` returns at once, so receivers would load uninitialised memory as weights."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    comm = PyNcclCommunicator(group, device=device)
    if comm.disabled:
        raise RuntimeError("vLLM's NCCL communicator for the weight group is disabled (libnccl could not be loaded, "
                           "VLLM_DISABLE_PYNCCL is set, or the group has a single member): its broadcasts would "
                           "send nothing; fix the NCCL install or set rollout.weight_sync=object_store")
    return comm


def stream_done(stream: Any) -> Callable[[], bool]:
    """Whether the work queued on `stream` until now has finished (a CUDA event recorded there)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event.query


def wait_for(done: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.01) -> None:
    """Until `done()`; a `TimeoutError` naming `what` after `timeout_s` (a NCCL broadcast whose peer never
    joins waits forever, and `torch.cuda.synchronize` with it)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s (trainer.dist_timeout_minutes): a "
                               "member of the NCCL weight group never joined the broadcast")
        time.sleep(poll_s)


def received_one_at_a_time(layout: list[tuple[str, tuple[int, ...], str]],
                           receive: Callable[[str, tuple[int, ...], str], torch.Tensor]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each weight of `layout`, received only when the loader asks for it, so the loader
    has copied the previous one into the model first. If the loader stops early (an error), the rest are
    still received and dropped: the sender broadcasts every weight, and a receiver that left would hang it."""
    pending, receiving = iter(layout), False
    try:
        for name, shape, dtype in pending:
            receiving = True
            tensor = receive(name, shape, dtype)
            receiving = False
            yield name, tensor
    finally:
        if not receiving:   # a failed receive means a broken group: nothing more will arrive
            for name, shape, dtype in pending:
                receive(name, shape, dtype)


class NcclWeightSender:
    """Learner rank 0's end of the NCCL weight group with the engines (it is rank 0 of `world_size`).
    The engines must join (`VLLMEngine.init_weight_group`) while this is constructed."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
        self.comm = nccl_communicator(group, torch.cuda.current_device())
        self.timeout_s = timeout_s

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast every weight, in `state`'s order (the engines receive in the same order); fails after
        `timeout_s` if an engine never takes them."""
        for tensor in state.values():
            self.comm.broadcast(tensor.detach().cuda().contiguous(), src=0, stream=torch.cuda.current_stream())
        wait_for(stream_done(torch.cuda.current_stream()), self.timeout_s, "sending the weights over NCCL")


class IpcWeightLoader:
    """Loads weights into an engine core in another process on this machine through vLLM's weight-transfer
    engine: CUDA IPC on a GPU (the engine starts with `weight_transfer_config: {backend: ipc}`), its CPU twin
    on the CPU (`anytime_cpu_ipc`, `anytime.rollout.engines.vllm.cpu_ipc`); the engine's workers map this process's
    tensors (`anytime.rollout.engines.vllm.ipc_handles`: only the handle differs). `api(method, *args, **kwargs)`
    calls the engine frontend. The protocol is vLLM's (init, then start / update / finish per sync), sent by
    this process alone; two things differ from vLLM's trainer-side `IPCTrainerWeightTransferEngine`:

    - the handles travel pickled in `ipc_handles_pickled`, as vLLM's own HTTP client sends them: the raw
      CUDA handles hold classes and a `torch.dtype`, which the msgpack encoder of `collective_rpc` refuses.
      The engine core decodes them because it starts with `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, and so does
      this process, which must then decode the engine core's typed replies (`process.weight_transfer_env`;
      the socket joins only our own two processes);
    - no collective on the learners' default process group: vLLM's sender all-gathers the handles over it,
      which in a multi-process learner only the rank that owns the engine enters (a hang).

    A failed update still ends the update session, so the next sync can start one."""

    def __init__(self, api: Callable[..., Any], device: torch.device) -> None:
        self._api = api
        self._device = device
        self._initialised = False

    @staticmethod
    def update_info(weights: list[tuple[str, torch.Tensor]], handles: list[dict[str, tuple]]) -> dict[str, Any]:
        """vLLM's `IPCWeightTransferUpdateInfo` fields for `weights` and their handles, as plain data."""
        return {"names": [name for name, _ in weights],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
                "shapes": [list(t.shape) for _, t in weights],
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}

    def load(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        from anytime.rollout.engines.vllm.ipc_handles import exported

        if not self._initialised:
            self._rpc("init_weight_transfer_engine", init_info={"packed": False})
            self._initialised = True
        # the engine maps the exported memory: it stays ours until the update has finished
        with exported(updates, self._device) as handles:
            info = self.update_info(updates, handles)
            self._rpc("start_weight_update")
            try:
                self._rpc("update_weights", update_info=info)
            except BaseException:
                with contextlib.suppress(Exception):   # the update's own error is the one to report
                    self._rpc("finish_weight_update")
                raise
            self._rpc("finish_weight_update")

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self._api("collective_rpc", method, kwargs=kwargs)
