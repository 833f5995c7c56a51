"""Rollout benchmark: thinking vs summaries on the hf and vllm engines (runs on CPU).

One anytime rollout = thinking traces, then summaries at every budget cut of every trace. Two
workloads on a random tiny model:

- ``fixed``: generation never stops early (no stop tokens); times both phases, and the hf engine's
  summary phase with and without reuse of the thinking KV cache.
- ``natural`` (vllm): traces end at lengths drawn from a log-normal distribution, like a reasoning
  model's (many short, a long tail, some reaching the largest budget), through the real anytime
  rollout (`AnytimeRolloutRunner`), with summaries run after all thinking (phased) and streamed
  (queued as each trace ends). A vLLM logits processor (`natural_lengths`) makes the random model
  end each trace at its drawn length, a function of the trace's seed, so both schedules see the
  same traces (checked: ``streamed_equals_phased``); `--vllm-frontends llm,async` runs it on both of
  the vLLM engine's frontends (AsyncLLM's engine core runs in a process of its own).
- ``seeds`` (vllm): the same generation of ``--seeds-prompts`` × ``--seeds-samples`` requests (every
  sample is a vLLM request of its own; no stop tokens, so every request runs ``--seeds-tokens``) with
  one seed per request, as every rollout samples by default, and unseeded (vLLM's own generator, what
  ``rollout.seed_requests: false`` gives); paired runs, alternating which goes first. Also times one
  call of vLLM's sampler on ``--seeds-rows`` rows of a ``--seeds-vocab`` vocabulary with a seeded
  generator per row and with none: the CPU path (``TopKTopPSampler.forward_cpu``) and
  ``random_sample``, the function that loops over seeded rows on a GPU (timed here on CPU tensors).

Prints ``name: value`` lines:
  summary_prefix_reuse_speedup     hf summary-phase time, naive re-prefill / prefix reuse (fixed)
  summary_overhead_hf              hf summary-phase time / thinking-phase time (fixed)
  summary_overhead_vllm            vllm summary-phase time / thinking-phase time (fixed)
  hf_tokens_per_s, vllm_tokens_per_s  thinking tokens per second (fixed)
  summary_overhead_vllm_phased     natural: (rollout time − thinking time) / thinking time, phased
  summary_overhead_vllm_streamed   natural: the same, streamed; "thinking time" is in both cases
                                   the phased run's thinking phase (the same traces, alone)
  rollout_s_streamed_over_phased   natural: rollout time (thinking + summaries, no verifier), streamed / phased
  ..._async                        the natural lines again on vLLM's AsyncLLM frontend (--vllm-frontends llm,async),
  rollout_s_streamed_async_over_llm  and its streamed rollout time over the stepped frontend's
  (medians over --repeats paired runs, alternating which schedule goes first)
  requests, seeded_s, unseeded_s   seeds: vLLM requests, and the generation's time (median) each way
  seeded_over_unseeded             seeds: seeded_s / unseeded_s
  seeded_tokens_per_s, unseeded_tokens_per_s  seeds: generated tokens per second each way
  sampler_cpu_ms_seeded, sampler_cpu_ms_unseeded        seeds: one forward_cpu call (median)
  random_sample_ms_seeded, random_sample_ms_unseeded    seeds: one random_sample call (median)
  sampler_cpu_us_per_seeded_row, random_sample_us_per_seeded_row  seeds: (seeded − unseeded) / rows

Usage: python benchmarks/rollout.py [--workloads fixed,natural,seeds] [--engines hf,vllm] [--prompts 8] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout to `name: value` lines

from anytime.models.tiny import build_tiny_model  # noqa: E402
from anytime.rollout.engines.engine import Branch, SamplingConfig, create_engine  # noqa: E402


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
    kwargs = {"cpu_threads_bind": bind, "kv_cache_gb": args.kv_cache_gb} if kind == "vllm" else {}
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


def _run_natural(model_dir: str, args, frontend: str) -> dict[str, float]:
    """Phased vs streamed anytime rollouts of the same seeds on one vLLM engine (on `frontend`); medians
    of paired runs."""
    import statistics

    from transformers import AutoTokenizer

    from anytime.data.prompts import render_prompt
    from anytime.reward.verifier import RewardScorer
    from anytime.config.answer_format import AnswerFormat
    from anytime.rollout.runner import AnytimeRolloutRunner
    from anytime.rollout.settings import AnytimeSettings

    from natural_lengths import NaturalLengths, natural_lengths_config   # beside this script

    tok = AutoTokenizer.from_pretrained(model_dir)
    budgets = tuple(int(b) for b in args.budgets.split(","))
    think_end = AnswerFormat().think_end_id(tok)
    lengths_config = natural_lengths_config(think_end, (think_end, tok.eos_token_id), budgets[-1],
                                            args.length_median * budgets[-1], args.length_sigma)
    prompts = [render_prompt(tok, f"Start with {i}. Add {17 * i + 3}. What is the last digit?")
               for i in range(args.prompts)]
    golds = [str((18 * i + 3) % 10) for i in range(args.prompts)]
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    max_len = max(len(p) for p in prompts) + budgets[-1] + args.summary_tokens + 32
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    same, lengths, capped = True, [], 0
    with create_engine("vllm", model_dir, max_model_len=max_len, seed=0, cpu_threads_bind=bind, frontend=frontend,
                       kv_cache_gb=args.kv_cache_gb, logits_processors=[NaturalLengths],
                       additional_config=lengths_config) as eng, RewardScorer(num_workers=1) as scorer:
        runner = AnytimeRolloutRunner(eng, tok, scorer, AnytimeSettings(
            budgets, args.traces, args.summaries, AnswerFormat(summary_max_tokens=args.summary_tokens)))
        eng.stream_summaries = True
        runner.run(prompts[:2], golds[:2], seed=10_000)  # warm-up
        for rep in range(args.repeats):
            outs = {}
            for stream in ((False, True) if rep % 2 == 0 else (True, False)):
                eng.stream_summaries = stream
                out = runner.run(prompts, golds, seed=rep)
                outs[stream] = out
                runs[stream].append((out.timings["gen"], out.timings["summaries"]))
            same &= all(torch.equal(getattr(outs[False], k), getattr(outs[True], k))
                        for k in ("think_ids", "think_len", "summary_ids", "summary_len", "scores"))
            lengths += outs[True].think_len.flatten().tolist()
            capped += int((~outs[True].natural_end).sum())
    think = statistics.median(g for g, _ in runs[False])
    rollout = {stream: statistics.median(g + s for g, s in runs[stream]) for stream in runs}
    lengths.sort()
    print(f"# natural ({frontend}): {len(lengths)} traces, lengths median {lengths[len(lengths) // 2]}, "
          f"p90 {lengths[int(0.9 * len(lengths))]}, {capped} reached the largest budget; "
          + "; ".join(f"{'streamed' if k else 'phased'} gen+summaries " + ", ".join(f"{g:.2f}+{s:.2f}" for g, s in v)
                      for k, v in runs.items()), file=sys.stderr)
    return {"think_s": think, "phased_s": rollout[False], "streamed_s": rollout[True], "same": float(same)}


def _run_seeds(model_dir: str, args) -> dict[str, float]:
    """Seeded vs unseeded vLLM generation of the same requests on one engine; medians of paired runs."""
    import statistics

    prompts, _ = _requests(model_dir, args.seeds_prompts)
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    seeded = SamplingConfig(max_new_tokens=args.seeds_tokens, n=args.seeds_samples, temperature=1.0, seed=0)
    unseeded = dataclasses.replace(seeded, seed=None)
    max_len = max(len(p) for p in prompts) + args.seeds_tokens + 8
    runs: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, int] = {}
    with create_engine("vllm", model_dir, max_model_len=max_len, seed=0, cpu_threads_bind=bind,
                       kv_cache_gb=args.kv_cache_gb) as eng:
        eng.generate(prompts, unseeded)  # warm-up; the prefix cache then holds every prompt for both
        for rep in range(args.repeats):
            for seed in ((True, False) if rep % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                out = eng.generate(prompts, seeded if seed else unseeded)
                runs[seed].append(time.perf_counter() - t0)
                tokens[seed] = sum(len(c.token_ids) for per_prompt in out for c in per_prompt)
    res: dict[str, float] = {"requests": float(len(prompts) * args.seeds_samples)}
    for seed, times in runs.items():
        way = "seeded" if seed else "unseeded"
        res[f"{way}_s"] = statistics.median(times)
        res[f"{way}_tokens_per_s"] = tokens[seed] / res[f"{way}_s"]
        print(f"# seeds, {way}: {len(prompts)} prompts x {args.seeds_samples} samples, {tokens[seed]} tokens in "
              + ", ".join(f"{t:.2f}" for t in times) + " s", file=sys.stderr)
    res.update(_time_sampler(args))
    return res


def _time_sampler(args) -> dict[str, float]:
    """One call of vLLM's sampler on [rows, vocab] logits, every row with a seeded generator of its own
    (what a seeded request brings) or none: `forward_cpu` (the CPU path) and `random_sample` (the
    function that loops over seeded rows on a GPU; here on CPU tensors, so only its loop's cost)."""
    import statistics

    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, random_sample

    rows, vocab = args.seeds_rows, args.seeds_vocab
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    gens = {i: torch.Generator().manual_seed(i) for i in range(rows)}
    sampler = TopKTopPSampler()
    calls = {
        "sampler_cpu": lambda g: sampler.forward_cpu(logits.clone(), g, None, None),
        "random_sample": lambda g: random_sample(logits.softmax(-1), g),
    }
    res: dict[str, float] = {}
    for name, call in calls.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.seeds_sampler_repeats + 1):
            for seed in ((True, False) if rep % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                call(gens if seed else {})
                if rep:  # the first pair warms up
                    times[seed].append(time.perf_counter() - t0)
        for seed, v in times.items():
            res[f"{name}_ms_{'seeded' if seed else 'unseeded'}"] = 1000 * statistics.median(v)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="fixed,natural",
                    help="fixed (never stops), natural (vllm, log-normal lengths), seeds (vllm, seeded vs unseeded)")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--traces", type=int, default=4)
    ap.add_argument("--think", type=int, default=1024, help="thinking tokens per trace")
    ap.add_argument("--budgets", default="256,512,768,1024")
    ap.add_argument("--summaries", type=int, default=4)
    ap.add_argument("--summary-tokens", type=int, default=16)
    ap.add_argument("--length-median", type=float, default=0.25, help="natural: median length / largest budget")
    ap.add_argument("--length-sigma", type=float, default=1.0, help="natural: sd of log length")
    ap.add_argument("--repeats", type=int, default=3, help="natural: paired phased/streamed runs")
    ap.add_argument("--vllm-frontends", default="llm",
                    help="natural: llm (vLLM's LLM stepped by anytime, in this process), async (AsyncLLM), or both")
    ap.add_argument("--seeds-prompts", type=int, default=64, help="seeds: prompts")
    ap.add_argument("--seeds-samples", type=int, default=8, help="seeds: samples per prompt (a vLLM request each)")
    ap.add_argument("--seeds-tokens", type=int, default=48, help="seeds: tokens each request generates")
    ap.add_argument("--seeds-rows", type=int, default=256,
                    help="seeds: sampler rows (vLLM's CPU default max_num_seqs is 256)")
    ap.add_argument("--seeds-vocab", type=int, default=1024,
                    help="seeds: sampler vocabulary (small, so that the per-row loop, not the noise, dominates)")
    ap.add_argument("--seeds-sampler-repeats", type=int, default=20, help="seeds: timed sampler calls each way")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25, help="vllm KV cache (0.25 GiB: ~128k tokens here)")
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

    workloads = [w for w in args.workloads.split(",") if w]
    frontends = [f for f in args.vllm_frontends.split(",") if f]
    if not set(frontends) <= {"llm", "async"}:
        ap.error(f"--vllm-frontends takes llm and/or async, got {args.vllm_frontends!r}")
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        print("# vllm is not installed: skipping the vllm engine", file=sys.stderr)
        engines.remove("vllm")

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp, _corpus(), hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=1))
        if "fixed" in workloads:
            prompts, close = _requests(model_dir, args.prompts)
            # hf first: an in-process vLLM engine pins torch's threads for the rest of the process.
            results = {
                kind: _run_engine(kind, model_dir, args, prompts, close) for kind in ("hf", "vllm") if kind in engines
            }
        natural = ({f: _run_natural(model_dir, args, f) for f in frontends}
                   if "natural" in workloads and "vllm" in engines else {})
        seeds = _run_seeds(model_dir, args) if "seeds" in workloads and "vllm" in engines else None

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
    for frontend, run in natural.items():
        tag, think = ("" if frontend == "llm" else f"_{frontend}"), run["think_s"]
        print(f"summary_overhead_vllm_phased{tag}: {(run['phased_s'] - think) / think:.3f}")
        print(f"summary_overhead_vllm_streamed{tag}: {(run['streamed_s'] - think) / think:.3f}")
        print(f"rollout_s_streamed_over_phased{tag}: {run['streamed_s'] / run['phased_s']:.3f}")
        print(f"streamed_equals_phased{tag}: {int(run['same'])}")
    if len(natural) == 2:
        print(f"rollout_s_streamed_async_over_llm: {natural['async']['streamed_s'] / natural['llm']['streamed_s']:.3f}")
    if seeds is not None:
        print(f"requests: {seeds['requests']:.0f}")
        print(f"seeded_s: {seeds['seeded_s']:.3f}")
        print(f"unseeded_s: {seeds['unseeded_s']:.3f}")
        print(f"seeded_over_unseeded: {seeds['seeded_s'] / seeds['unseeded_s']:.3f}")
        print(f"seeded_tokens_per_s: {seeds['seeded_tokens_per_s']:.0f}")
        print(f"unseeded_tokens_per_s: {seeds['unseeded_tokens_per_s']:.0f}")
        for name in ("sampler_cpu", "random_sample"):
            for way in ("seeded", "unseeded"):
                print(f"{name}_ms_{way}: {seeds[f'{name}_ms_{way}']:.3f}")
            extra = (seeds[f"{name}_ms_seeded"] - seeds[f"{name}_ms_unseeded"]) * 1000 / args.seeds_rows
            print(f"{name}_us_per_seeded_row: {extra:.2f}")


if __name__ == "__main__":
    main()
