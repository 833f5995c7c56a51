"""Weight-sync benchmark: learner weights into a vLLM engine, in-process vs in its own process.

A lone learner keeps the engine in its process (weights handed over by reference); a multi-process
learner runs it in a process of its own and ships the weights through vLLM's weight transfer (on the
CPU the twin of its CUDA IPC backend: a shared-memory file the engine's worker maps).
This script times ``update_weights`` (including the prefix-cache reset) in both layouts on one model.

Prints ``name: value`` lines:
  weights_mb                  size of the state dict sent (tied tensors counted twice, as sent)
  sync_s_in_process           median seconds per update_weights, engine in this process
  sync_s_own_process          median seconds per update_weights, engine in its own process
  own_over_in_process         the ratio of the two

Usage: python benchmarks/weight_sync.py [--model DIR] [--repeats 3]
(default model: a random Qwen2 of about SmolLM2-135M's size, built from a config)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout to `name: value` lines

from anytime.models.tiny import build_tiny_model  # noqa: E402
from anytime.rollout.engines.engine import create_engine  # noqa: E402


def _time_updates(model_dir: str, own_process: bool, state: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    engine = create_engine("vllm", model_dir, max_model_len=256, own_process=own_process)
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.update_weights(state)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint (default: a random ~130M Qwen2)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as scratch:  # the built model is 650 MB
        model_dir = args.model
        if model_dir is None:
            corpus = [f"{a} plus {b} is {a + b}" for a in range(50) for b in range(50)]
            model_dir = str(build_tiny_model(scratch, corpus, hidden_size=576, num_layers=30, num_heads=9,
                                             num_kv_heads=3, vocab_size=49152, intermediate_size=1536))
        from transformers import AutoModelForCausalLM

        state = list(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())
        print(f"weights_mb: {sum(t.numel() * t.element_size() for _, t in state) / 1e6:.0f}")
        inproc = _time_updates(model_dir, False, state, args.repeats)
        own = _time_updates(model_dir, True, state, args.repeats)
    print(f"sync_s_in_process: {inproc:.3f}")
    print(f"sync_s_own_process: {own:.3f}")
    print(f"own_over_in_process: {own / inproc:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
