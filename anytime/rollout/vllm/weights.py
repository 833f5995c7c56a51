"""The worker side of weight sync with vLLM: methods mixed into vLLM's worker (reached through
``collective_rpc``), learner rank 0's end of the NCCL weight group, and the sender of vLLM's CUDA IPC
weight-transfer engine for an engine core in a process of its own (both GPU only)."""

from __future__ import annotations

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
        """Receive every weight of `layout` (name, shape, dtype) by broadcast from learner rank 0, then load."""
        weights = []
        for name, shape, dtype in layout:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)  # type: ignore[attr-defined]
            self._anytime_nccl.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            weights.append((name, tensor))
        torch.cuda.synchronize()
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]


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


class _EngineSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol (four methods) over the engine's own `collective_rpc`,
    which reaches the same worker methods on either frontend (`LLM` and `AsyncLLM`)."""

    def __init__(self, api: Callable[..., Any]) -> None:
        self._api = api

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._api("collective_rpc", "init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._api("collective_rpc", "start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._api("collective_rpc", "update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._api("collective_rpc", "finish_weight_update")   # the engine labels the version itself


class IpcWeightLoader:
    """Loads weights into an engine core in another process on the same GPU through vLLM's weight-transfer
    engine with the CUDA IPC backend (the engine starts with `weight_transfer_config: {backend: ipc}`):
    the tensors go to this process's GPU and the engine's workers map them. `api(method, *args, **kwargs)`
    calls the engine frontend. Untested: no GPU runs this project's tests."""

    def __init__(self, api: Callable[..., Any]) -> None:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        self._batch: list[tuple[str, torch.Tensor]] = []
        # a full-resync sender replays its source on every send: the source is this loader's current batch
        self._sender = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=_EngineSyncClient(api), source=self)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._batch)

    def load(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        self._batch = [(name, t.to(device)) for name, t in updates]
        try:
            self._sender.send_weights()
        finally:
            self._batch = []
