"""The worker side of weight sync with vLLM: methods mixed into vLLM's worker (reached through
``collective_rpc``), learner rank 0's end of the NCCL weight group, and the sender of vLLM's CUDA IPC
weight-transfer engine for an engine core in a process of its own (both GPU only)."""

from __future__ import annotations

import base64
import contextlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch


class AnytimeWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``); they run where the model lives,
    in this process or in the engine's own process, and are reached by name through ``collective_rpc``."""

    def anytime_load_weights(self, weights: str | list[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named weights: a list of (name, tensor) in-process, or the path of a
        safetensors file when the engine runs in its own process (RPC arguments cannot carry tensors)."""
        if isinstance(weights, str):
            from safetensors.torch import load_file

            weights = list(load_file(weights).items())
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]

    def anytime_init_weight_group(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Join a NCCL group with learner rank 0 (its rank 0) for weight broadcasts (GPU only)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        self._anytime_nccl = PyNcclCommunicator(group, device=self.device)  # type: ignore[attr-defined]

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
        torch.cuda.synchronize()


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

    def __init__(self, host: str, port: int, world_size: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
        self.comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast every weight, in `state`'s order (the engines receive in the same order)."""
        for tensor in state.values():
            self.comm.broadcast(tensor.detach().cuda().contiguous(), src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()


class IpcWeightLoader:
    """Loads weights into an engine core in another process on the same GPU through vLLM's weight-transfer
    engine with the CUDA IPC backend (the engine starts with `weight_transfer_config: {backend: ipc}`): the
    engine's workers map this process's GPU tensors, no host copy. `api(method, *args, **kwargs)` calls the
    engine frontend. The protocol is vLLM's (init, then start / update / finish per sync), sent by this
    process alone; two things differ from vLLM's trainer-side `IPCTrainerWeightTransferEngine`:

    - the handles travel pickled in `ipc_handles_pickled`, as vLLM's own HTTP client sends them: the raw
      handles hold classes and a `torch.dtype`, which the msgpack encoder of `collective_rpc` refuses. The
      engine core decodes them because it starts with `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (see
      `VLLMEngine`; its socket joins only our own two processes);
    - no collective on the learners' default process group: vLLM's sender all-gathers the handles over it,
      which in a multi-process learner only the rank that owns the engine enters (a hang).

    A failed update still ends the update session, so the next sync can start one."""

    def __init__(self, api: Callable[..., Any], device: torch.device) -> None:
        self._api = api
        self._device = device
        self._initialised = False

    def handle(self, tensor: torch.Tensor) -> dict[str, tuple[Any, ...]]:
        """`tensor`'s CUDA IPC handle, keyed by its GPU's UUID (what vLLM's receiver looks up)."""
        from torch.multiprocessing.reductions import reduce_tensor

        return {str(torch.cuda.get_device_properties(tensor.device).uuid): reduce_tensor(tensor)[1]}

    def update_info(self, weights: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """vLLM's `IPCWeightTransferUpdateInfo` fields for `weights`, as plain data."""
        handles = [self.handle(t) for _, t in weights]
        return {"names": [name for name, _ in weights],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
                "shapes": [list(t.shape) for _, t in weights],
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}

    def load(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        if not self._initialised:
            self._rpc("init_weight_transfer_engine", init_info={"packed": False})
            self._initialised = True
        # the engine maps these very tensors: they stay referenced here until it has loaded them
        shared = [(name, t.detach().to(self._device).contiguous()) for name, t in updates]
        info = self.update_info(shared)
        self._rpc("start_weight_update")
        try:
            self._rpc("update_weights", update_info=info)
        except BaseException:
            with contextlib.suppress(Exception):   # the update's own error is the one to report
                self._rpc("finish_weight_update")
            raise
        self._rpc("finish_weight_update")
        del shared
        if self._device.type == "cuda":
            torch.cuda.ipc_collect()

    def _rpc(self, method: str, **kwargs: Any) -> None:
        self._api("collective_rpc", method, kwargs=kwargs)
