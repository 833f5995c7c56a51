"""anytime's entry in vLLM's plugin group `vllm.general_plugins` (pyproject.toml), which vLLM loads in each
of its processes (the frontend, the engine core, its workers): it registers the CPU twin of the IPC
weight-transfer backend by name, so an engine core started with `weight_transfer_config: {backend:
anytime_cpu_ipc}` can build it. The engine's module is imported only by an engine that names it, so any
other vLLM process on a machine with anytime installed pays nothing for this."""

from __future__ import annotations

CPU_IPC_BACKEND = "anytime_cpu_ipc"   # the name engines give `weight_transfer_config.backend` on the CPU
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "anytime_cpu_ipc"


def register() -> None:
    """Register the backend with vLLM's weight-transfer factory (plugins load more than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(CPU_IPC_BACKEND, "anytime.rollout.engines.vllm.cpu_ipc",
                                                    "CpuIpcWeightTransferEngine")
    except ValueError as e:
        if "already registered" not in str(e):
            raise


def plugin_installed() -> bool:
    """Whether vLLM's processes will find `register` (an installed anytime declares it; a source tree on
    sys.path alone does not)."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME and ep.value == f"{__name__}:register"
               for ep in entry_points(group=PLUGIN_GROUP))


def cpu_ipc_backend() -> str:
    """The backend an engine core of its own names on the CPU; refused, saying how to fix it, where vLLM's
    processes would not find it (they would fail at start with an unknown backend)."""
    import os

    if not plugin_installed():
        raise RuntimeError("vLLM cannot find anytime's weight-transfer plugin (entry point "
                           f"{PLUGIN_GROUP}:{PLUGIN_NAME}): install anytime (pip install -e .) rather than running "
                           "it from a source folder on sys.path")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        raise RuntimeError(f"VLLM_PLUGINS={allowed!r} leaves out anytime's weight-transfer plugin: add "
                           f"{PLUGIN_NAME} to it (or unset it)")
    return CPU_IPC_BACKEND
