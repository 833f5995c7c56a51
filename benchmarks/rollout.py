"""Rollout benchmark: thinking phase vs summary phase on the hf and vllm engines (runs on CPU).

One anytime rollout = thinking traces, then summaries at every budget cut of every trace. This
script times both phases on a random tiny model (generation never stops early: no stop tokens),
and the hf engine's summary phase with and without reuse of the thinking KV cache.

Prints ``name: value`` lines:
  summary_prefix_reuse_speedup  hf summary-phase time, naive re-prefill / prefix reuse
  summary_overhead_hf           hf summary-phase time / thinking-phase time
  summary_overhead_vllm         vllm summary-phase time / thinking-phase time
  hf_tokens_per_s               thinking tokens per second, hf
  vllm_tokens_per_s             thinking tokens per second, vllm

Usage: python benchmarks/rollout.py [--engines hf,vllm] [--prompts 8] [--traces 4] [--threads 1] ...
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout to `name: value` lines

from anytime.rollout.engine import Branch, SamplingConfig, create_engine  # noqa: E402
from anytime.tiny import build_tiny_model  # noqa: E402


def _corpus() -> list[str]:
    return [
        f"Question: what is {a} + {b}? <think>\n{a} plus {b}: add the units, carry, the sum is {a + b}.\n</think>\n\n"
        f"**Final Answer**\n\\boxed{{{a + b}}}"
        for a in range(40)
        for b in range(40)
    ]


def _requests(model_dir: str, num_prompts: int) -> tuple[list[list[int]], tuple[int, ...]]:
    """Chat-templated prompts and the forced-close suffix inserted at every budget cut."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {17 * i + 3} + {29 * i + 11}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(num_prompts)
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    close = tuple(tok.encode("...\n\n</think>\n\n**Final Answer**\n", add_special_tokens=False))
    return prompts, close


def _run_engine(kind: str, model_dir: str, args, prompts, close) -> dict[str, float]:
    budgets = [int(b) for b in args.budgets.split(",")]
    max_len = max(len(p) for p in prompts) + args.think + len(close) + args.summary_tokens + 8
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    kwargs = {"cpu_threads_bind": bind} if kind == "vllm" else {}
    think = SamplingConfig(max_new_tokens=args.think, n=args.traces, temperature=1.0, seed=0)
    summ = SamplingConfig(max_new_tokens=args.summary_tokens, n=args.summaries, temperature=1.0, seed=1)
    res: dict[str, float] = {}
    with create_engine(kind, model_dir, max_model_len=max_len, seed=0, **kwargs) as eng:
        eng.generate(prompts[:1], SamplingConfig(max_new_tokens=8, temperature=1.0))  # warm-up

        t0 = time.perf_counter()
        traces = eng.generate(prompts, think)
        res["think_s"] = time.perf_counter() - t0
        n_tokens = sum(len(c.token_ids) for per_prompt in traces for c in per_prompt)
        res["tokens_per_s"] = n_tokens / res["think_s"]

        prefixes, branches = [], []
        for prompt, per_prompt in zip(prompts, traces):
            for c in per_prompt:
                prefixes.append(prompt + c.token_ids)
                branches.append([Branch(cut=len(prompt) + min(b, len(c.token_ids)), suffix=close) for b in budgets])

        t0 = time.perf_counter()
        eng.generate_branches(prefixes, branches, summ)
        res["summary_s"] = time.perf_counter() - t0
        if kind == "hf":
            eng.prefix_reuse = False
            t0 = time.perf_counter()
            eng.generate_branches(prefixes, branches, summ)
            res["summary_naive_s"] = time.perf_counter() - t0
    print(
        f"# {kind}: {len(prefixes)} traces, {n_tokens} thinking tokens, "
        + ", ".join(f"{k}={v:.2f}" for k, v in res.items()),
        file=sys.stderr,
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--traces", type=int, default=4)
    ap.add_argument("--think", type=int, default=1024, help="thinking tokens per trace")
    ap.add_argument("--budgets", default="256,512,768,1024")
    ap.add_argument("--summaries", type=int, default=4)
    ap.add_argument("--summary-tokens", type=int, default=16)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for both engines (torch threads for hf, bound cores for vllm). Default 1: on a shared "
        "2-core machine a second OpenMP thread that gets descheduled stalls every matmul",
    )
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)

    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        print("# vllm is not installed: skipping the vllm engine", file=sys.stderr)
        engines.remove("vllm")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp, _corpus(), hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=1))
        prompts, close = _requests(model_dir, args.prompts)
        # hf first: an in-process vLLM engine pins torch's threads for the rest of the process.
        results = {
            kind: _run_engine(kind, model_dir, args, prompts, close) for kind in ("hf", "vllm") if kind in engines
        }

    if "hf" in results:
        hf = results["hf"]
        print(f"summary_prefix_reuse_speedup: {hf['summary_naive_s'] / hf['summary_s']:.2f}")
        print(f"summary_overhead_hf: {hf['summary_s'] / hf['think_s']:.3f}")
    if "vllm" in results:
        print(f"summary_overhead_vllm: {results['vllm']['summary_s'] / results['vllm']['think_s']:.3f}")
    if "hf" in results:
        print(f"hf_tokens_per_s: {results['hf']['tokens_per_s']:.0f}")
    if "vllm" in results:
        print(f"vllm_tokens_per_s: {results['vllm']['tokens_per_s']:.0f}")


if __name__ == "__main__":
    main()
