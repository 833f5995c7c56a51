"""How much of one AdamW step at the paper's learning rate (1e-6) reaches bf16 weights.

A small random Qwen2 (fixed seed) is cast to bf16, as the learner factory loads it with
`model.dtype: bfloat16`. One forward/backward of the torch learner on a fixed random batch gives a
gradient; then, from the same starting weights and with that same gradient:

  intended   torch AdamW on float32 copies of the weights: the update the optimizer means to make
  ours       `TorchLearner`'s optimizer step (float32 masters of the bf16 weights)
  plain      torch AdamW run directly on the bf16 weights (what a bf16 model without masters gets)

For each of ours / plain, over every trainable element, with Δ = weights after − weights before
(in float32) and Δ* the intended update:

  *_update_kept     ‖Δ‖ / ‖Δ*‖: the share of the intended update's size that reached the weights
                    (1 = all of it; rounding to bf16 loses small steps and overshoots a few by up
                    to a bf16 spacing, so read it with the error below)
  *_update_error    ‖Δ − Δ*‖ / ‖Δ*‖: how far the realized update is from the intended one (0 = exact)
  *_elements_moved  the share of elements with Δ* ≠ 0 whose value changed

Prints `name: value` lines: bf16_update_kept (ours) and plain_bf16_adamw_update_kept (plain) first.
Gradient clipping is off so the reference takes the learner's gradient as it is.

Then what bf16 costs on this CPU (what `learner.bf16: auto` decides by, `anytime.core.precision`): one
M x K @ K x N matmul (`--gemm`, SmolLM2-135M's MLP shape by default), the median of `--repeats` runs:

  cpu_capability, cpu_native_bf16      torch's CPU capability string; 1 if the CPU has bf16 instructions
  cpu_bf16_path                        native | converted (oneDNN on AVX-512 without AVX512_BF16, ~4x
                                       float32 on a Xeon) | reference (torch's own GEMM)
  gemm_fp32_ms, gemm_bf16_ms           float32 and bf16 tensors
  gemm_bf16_over_fp32                  their ratio (below 1: bf16 pays here)
  gemm_bf16_reference_ms               bf16 with oneDNN switched off: torch's reference GEMM, the one a CPU
  gemm_bf16_reference_over_fp32        without native bf16 (AVX2 only) runs; ~34x float32 on an AVX2 EPYC

Usage: python benchmarks/precision.py [--hidden 256] [--layers 4] [--vocab 2048] [--rows 4] [--tokens 64]
                                      [--lr 1e-6] [--seed 0] [--gemm 1024x576x1536] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=args.hidden // 4, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)


def fixed_batch(args: argparse.Namespace):
    """`rows` rows of `tokens` random tokens, a 16-token prompt, random advantages."""
    from anytime.batch.train_batch import TrainBatch

    gen = torch.Generator().manual_seed(args.seed)
    rows, tokens = args.rows, args.tokens
    trained = torch.ones(rows, tokens - 1, dtype=torch.bool)
    trained[:, :16] = False
    zeros = torch.zeros_like(trained)
    return TrainBatch(torch.randint(0, args.vocab, (rows, tokens), generator=gen), torch.full((rows,), tokens),
                      torch.arange(rows), trained, zeros, zeros, torch.randn(rows, tokens - 1, generator=gen),
                      torch.zeros(rows, tokens - 1), torch.full((rows, tokens - 1), -10.0),
                      trained.sum(1), traces_per_prompt=1, max_len=tokens)


def adamw_step(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """One torch AdamW step on copies of `weights` (their dtype) with `grads`; the weights after it."""
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    for n, p in params.items():
        p.grad = grads[n].to(p.dtype)
    torch.optim.AdamW(params.values(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay).step()
    return {n: p.detach() for n, p in params.items()}


def report(name: str, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
           intended: dict[str, torch.Tensor]) -> None:
    real = torch.cat([(after[n].float() - before[n]).flatten() for n in before])
    want = torch.cat([(intended[n] - before[n]).flatten() for n in before])
    pushed = want != 0
    print(f"{name}_update_kept: {float(real.norm() / want.norm()):.4f}")
    print(f"{name}_update_error: {float((real - want).norm() / want.norm()):.2e}")
    print(f"{name}_elements_moved: {float((real[pushed] != 0).float().mean()):.4f}")


def matmul_ms(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Median wall milliseconds of `a @ b` after one untimed run."""
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def report_gemm(shape: str, repeats: int, seed: int) -> None:
    from anytime.core.precision import cpu_bf16_path, cpu_capability, cpu_native_bf16

    m, k, n = (int(x) for x in shape.split("x"))
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    fp32 = matmul_ms(a, b, repeats)
    bf16 = matmul_ms(a.bfloat16(), b.bfloat16(), repeats)
    print(f"cpu_capability: {cpu_capability()}")
    print(f"cpu_native_bf16: {int(cpu_native_bf16())}")
    print(f"cpu_bf16_path: {cpu_bf16_path()}")
    print(f"gemm_fp32_ms: {fp32:.2f}")
    print(f"gemm_bf16_ms: {bf16:.2f}")
    print(f"gemm_bf16_over_fp32: {bf16 / fp32:.2f}")
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False   # the matmul dispatch's oneDNN check fails, as on an AVX2-only CPU
    try:
        reference = matmul_ms(a.bfloat16(), b.bfloat16(), 1)   # seconds a run there: one is enough
    finally:
        torch.backends.mkldnn.enabled = enabled
    print(f"gemm_bf16_reference_ms: {reference:.2f}")
    print(f"gemm_bf16_reference_over_fp32: {reference / fp32:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gemm", default="1024x576x1536", help="MxKxN of the timed matmul")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each matmul (the median is printed)")
    args = parser.parse_args()
    from anytime.algo.loss import LossSpec
    from anytime.config import LearnerConfig
    from anytime.learner.data_parallel import TorchLearner

    cfg = LearnerConfig(lr=args.lr, grad_clip=0.0, micro_batch_tokens=args.rows * args.tokens)
    model = build_model(args)
    start = {n: p.detach().float().clone() for n, p in model.named_parameters()}   # the bf16 weights, exactly
    learner = TorchLearner(model, cfg, total_steps=1)
    batch = fixed_batch(args)
    learner.forward_backward(batch, LossSpec(num_tokens=float(batch.loss_mask.sum()), on_policy=True))
    grads = {n: p.grad.detach().clone() for n, p in learner.model.named_parameters()}
    learner.optimizer_step()
    ours = {n: p.detach() for n, p in learner.model.named_parameters()}
    intended = adamw_step(start, grads, cfg)
    plain = adamw_step({n: w.bfloat16() for n, w in start.items()}, grads, cfg)
    print(f"parameters: {sum(w.numel() for w in start.values())}")
    report("bf16", start, ours, intended)
    report("plain_bf16_adamw", start, plain, intended)
    report_gemm(args.gemm, args.repeats, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
