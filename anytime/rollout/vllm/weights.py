"""The worker side of weight sync with vLLM: methods mixed into vLLM's worker (reached through
``collective_rpc``), and learner rank 0's end of the NCCL weight group (GPU only)."""

from __future__ import annotations

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
