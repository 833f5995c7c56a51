"""The CPU twin of vLLM's CUDA IPC weight-transfer backend, so that on the CPU an engine core in a process
of its own takes weights through the very conversation it has on a GPU: `init_weight_transfer_engine`,
then `start_weight_update` → `update_weights` → `finish_weight_update` over `collective_rpc`, pickled
handles in the update info, typed replies, both ends started with the same environment.

vLLM builds the backend a recipe names in every worker (`Worker.load_model` → `WeightTransferEngineFactory`,
shared by `CPUWorker`); the name is registered in every vLLM process by our entry point in vLLM's
`vllm.general_plugins` group (`anytime.rollout.engines.vllm.plugin`). The engine is vLLM's `IPCWeightTransferEngine`
with only the device primitive swapped: a handle names a shared-memory file's bytes instead of a CUDA
allocation (`anytime.rollout.engines.vllm.ipc_handles`), and a CPU copy is complete when it returns (no device to
synchronise). The layer-wise reload around an update is vLLM's own.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo

from anytime.rollout.engines.vllm.ipc_handles import rebuilt_on_cpu


class CpuIpcWeightTransferEngine(IPCWeightTransferEngine):
    """vLLM's IPC weight-transfer engine on the CPU: each handle maps the sender's shared-memory file."""

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.packed or not isinstance(update_info.ipc_handles, list):
            raise ValueError("the CPU IPC weight transfer takes one handle per weight (init_info packed=False)")
        weights = rebuilt_on_cpu(update_info.ipc_handles, update_info.dtype_names, update_info.shapes)
        with disable_mtp_completeness_check():
            self.model.load_weights(list(zip(update_info.names, weights)))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronises the accelerator after the receive, and a CPU-only torch has none
        self.receive_weights(self.parse_update_info(update_info))
