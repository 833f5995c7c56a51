"""vLLM in anytime: the ONLY package that imports vllm (always lazily, inside functions).

- `engine`: the rollout engine (`VLLMEngine`) on vLLM's offline `LLM`, stepped by us: requests,
  streamed summaries, weights and memory;
- `async_engine`: the same engine on vLLM's `AsyncLLM` (`AsyncVLLMEngine`, `rollout.vllm_frontend: async`);
- `weights`: the worker side of weight sync (`AnytimeWorkerExtension`, reached through
  ``collective_rpc``) and learner rank 0's NCCL sender;
- `process`: where the engine runs (in this process or one of its own) and what it leaves behind.
"""

from typing import Any

from anytime.rollout.engines.vllm.async_engine import AsyncVLLMEngine
from anytime.rollout.engines.vllm.engine import VLLMEngine
from anytime.rollout.engines.vllm.weights import NcclWeightSender

FRONTENDS = ("llm", "async")


def vllm_engine(model_path: str, *, frontend: str = "llm", **kwargs: Any) -> VLLMEngine:
    """The vLLM rollout engine on the `frontend` named (`rollout.vllm_frontend`): "llm", vLLM's offline
    `LLM` stepped by us (in this process or one of its own), or "async", vLLM's `AsyncLLM`."""
    if frontend not in FRONTENDS:
        raise ValueError(f"vLLM frontend must be one of {FRONTENDS}, got {frontend!r}")
    return (AsyncVLLMEngine if frontend == "async" else VLLMEngine)(model_path, **kwargs)


__all__ = ["FRONTENDS", "AsyncVLLMEngine", "NcclWeightSender", "VLLMEngine", "vllm_engine"]
