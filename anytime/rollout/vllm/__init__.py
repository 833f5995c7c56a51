"""vLLM in anytime: the ONLY package that imports vllm (always lazily, inside functions).

- `engine`: the rollout engine (`VLLMEngine`): requests, streamed summaries, weights and memory;
- `weights`: the worker side of weight sync (`AnytimeWorkerExtension`, reached through
  ``collective_rpc``) and learner rank 0's NCCL sender;
- `process`: where the engine runs (in this process or one of its own) and what it leaves behind.
"""

from anytime.rollout.vllm.engine import VLLMEngine
from anytime.rollout.vllm.weights import NcclWeightSender

__all__ = ["NcclWeightSender", "VLLMEngine"]
