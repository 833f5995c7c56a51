"""Learner benchmark: tree-packed rows (one row per trace, its summaries as branches) against a row per
summary, and LM-head log-probs in chunks against the full logits.

Each setting trains the torch learner (float32, one thread) on a synthetic rollout: random token
ids with the shapes of a real one (the learner's cost depends only on shapes), real BRPO advantages
of random scores, zero-advantage sequences dropped as in training. Half the traces close their
thinking by themselves before the largest budget (their later budgets share one summary prompt).
- `quickstart`: the CPU quickstart's proportions and learner: hidden 64 × 3 layers, 8 prompts × 8
  traces, ~84-token prompts, budgets 16/32/48/64, 2 summaries of ≤ 8 tokens per budget,
  micro-batches of 8192 tokens;
- `paper`: the paper's proportions scaled down: hidden 128 × 4 layers, 2 prompts × 4 traces,
  150-token prompts, budgets 256/512/768/1024, 4 summaries of ≤ 32 tokens per budget (the paper:
  8000 thinking tokens, 4 × 4 summaries of ≤ 128), micro-batches of 16384 tokens.

Every measurement runs in a fresh process (`--child`), so peak memory is that process's own.

Prints ``name@setting: value`` lines:
  learner_tokens_rows / _packed     tokens the learner runs per step (sum of row lengths)
  packed_over_rows_tokens           their ratio
  update_s_rows / _packed           seconds of the PPO update (forward/backward + optimizer step), the
                                    fastest of `--repeats` runs, rows and packed runs interleaved (other
                                    jobs on the machine slow single runs by up to several times)
  update_s_packed_over_rows         their ratio
  logprob_s_packed_over_rows        the same for the old log-probs pass
  peak_mem_rows_mb / _packed_mb     peak RSS growth of the update when one micro-batch holds the
                                    rows of `memory` traces (the activation memory of the same traces
                                    in one pass; rows are padded to the longest, as a learner does)
  peak_mem_packed_over_rows         their ratio
and, for one micro-batch of 8192 tokens with a 49,152-token vocabulary and SmolLM2-135M's hidden size
576 (LM head, log-softmax, entropy and their backward):
  peak_mem_logprob_full_mb / _chunked_mb, peak_mem_logprob_chunked_over_full (chunks of 1024 tokens)

Usage: python benchmarks/learner_packing.py [--settings quickstart,paper] [--repeats 2] [--skip-logprob]
Timings need a quiet machine; `load_average` is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class Setting:
    hidden: int
    layers: int
    prompts: int
    traces: int
    budgets: tuple[int, ...]
    summaries: int
    summary_tokens: int
    prompt_tokens: int
    micro_batch_tokens: int
    memory_prompts: int          # the memory runs train this many prompts' traces in one micro-batch
    memory_traces: int


SETTINGS = {
    "quickstart": Setting(64, 3, 8, 8, (16, 32, 48, 64), 2, 8, 84, 8192, 2, 8),
    "paper": Setting(128, 4, 2, 4, (256, 512, 768, 1024), 4, 32, 150, 16384, 1, 2),
}
CLOSE, HEADER = (7, 8, 9, 10), (11, 12, 13, 14, 15, 16)    # token counts of the quickstart tokenizer's
VOCAB = 512


def synthetic_rollout(s: Setting, prompts: int, traces: int, seed: int = 0):
    """An `AnytimeRollout` with random tokens and the real plan (cuts, forced closes, prefix groups)."""
    from anytime.batch.anytime_rollout import AnytimeRollout, padded
    from anytime.reward.verifier import REASONS

    gen = torch.Generator().manual_seed(seed)

    def ints(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    def tokens(n: int) -> list[int]:
        return torch.randint(20, VOCAB, (n,), generator=gen).tolist()

    B, G, S, A, top = prompts, traces, len(s.budgets), s.summaries, s.budgets[-1]
    prompt = [tokens(ints(int(0.85 * s.prompt_tokens), int(1.15 * s.prompt_tokens))) for _ in range(B)]
    think, natural, cuts, forced, groups, summaries = [], [], [], [], [], []
    for _ in range(B * G):
        closed = bool(torch.rand(1, generator=gen) < 0.5)
        n = ints(s.budgets[0] // 2, top - 1) if closed else top
        think.append(tokens(n))
        natural.append(closed)
        seen: dict[int, int] = {}
        for b in s.budgets:
            past = closed and n <= b
            cuts.append(n if past else b)
            forced.append(not past)
            groups.append(seen.setdefault(cuts[-1], len(seen)))
            summaries += [tokens(ints(s.summary_tokens // 2, s.summary_tokens)) for _ in range(A)]
    scores = (torch.rand(B, G, S, A, generator=gen) < 0.4).float()
    return AnytimeRollout(
        budgets=list(s.budgets), golds=["0"] * B, prompt_ids=padded(prompt, torch.long, (B,)),
        prompt_len=torch.tensor([len(p) for p in prompt]), think_ids=padded(think, torch.long, (B, G)),
        think_logprobs=-torch.rand(B, G, top, generator=gen),
        think_len=torch.tensor([len(t) for t in think]).view(B, G),
        natural_end=torch.tensor(natural).view(B, G), eos_end=torch.zeros(B, G, dtype=torch.bool),
        cut=torch.tensor(cuts).view(B, G, S), forced_close=torch.tensor(forced).view(B, G, S),
        prefix_group=torch.tensor(groups).view(B, G, S), summary_ids=padded(summaries, torch.long, (B, G, S, A)),
        summary_logprobs=-torch.rand(B, G, S, A, s.summary_tokens, generator=gen),
        summary_len=torch.tensor([len(x) for x in summaries]).view(B, G, S, A), scores=scores,
        reasons=torch.full((B, G, S, A), REASONS.index("wrong")), answers=[None] * (B * G * S * A),
        texts=[""] * (B * G * S * A), close_ids=CLOSE, header_ids=HEADER)


def train_batch(s: Setting, prompts: int, traces: int, pack: bool):
    from anytime.algo.advantages import summary_advantages_by_name, thinking_advantages
    from anytime.batch.packing import build_train_batch
    from anytime.trainer.experience import loss_width, token_advantages

    rollout = synthetic_rollout(s, prompts, traces)
    probs = [1.0 / len(s.budgets)] * len(s.budgets)
    t_adv = thinking_advantages("brpo", rollout.budget_scores.double(), probs, decay=0.5, variant="brpo")
    s_adv = summary_advantages_by_name("brpo", rollout.scores.double(), rollout.prefix_group)
    tokens, summaries = token_advantages(rollout, t_adv, s_adv)
    return build_train_batch(rollout, tokens, summaries, max_len=loss_width(rollout, s.summary_tokens), pack=pack)


def _peak_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM := VmRSS
        f.write("5")


def child_update(name: str, layout: str, mode: str) -> dict:
    """One learner on one layout: timed log-probs + update, or the update's peak memory."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from anytime.config import AlgorithmConfig, LearnerConfig
    from anytime.learner.data_parallel import TorchLearner
    from anytime.learner.ppo import ppo_update

    s = SETTINGS[name]
    memory = mode == "memory"
    prompts, traces = (s.memory_prompts, s.memory_traces) if memory else (s.prompts, s.traces)
    batch = train_batch(s, prompts, traces, pack=layout == "packed")
    config = Qwen2Config(hidden_size=s.hidden, intermediate_size=4 * s.hidden, num_hidden_layers=s.layers,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    cfg = LearnerConfig(lr=1e-4, mini_batch_prompts=prompts, pack_summaries=layout == "packed",
                        micro_batch_tokens=10**9 if memory else s.micro_batch_tokens)
    learner = TorchLearner(model, cfg, total_steps=1)
    algo = AlgorithmConfig(loss_agg="constant")
    start = time.perf_counter()
    batch.old_logprobs = learner.logprobs(batch)
    logprob_s = time.perf_counter() - start
    _reset_peak()
    base = _rss_kb()
    start = time.perf_counter()
    ppo_update(learner, batch, algo, cfg)
    return {"tokens": int(batch.lengths.sum()), "padded": len(batch) * batch.input_ids.shape[1], "rows": len(batch),
            "logprob_s": logprob_s, "update_s": time.perf_counter() - start, "peak_mb": (_peak_kb() - base) / 1024}


def child_logprob(mode: str, tokens: int = 8192, vocab: int = 49152, hidden: int = 576, chunk: int = 1024) -> dict:
    """Peak memory of log-probs + entropies of `tokens` tokens and their backward, full or chunked."""
    from anytime.algo.logprobs import selected_logprobs, token_entropy, token_logprobs

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(1, tokens, hidden, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    _reset_peak()
    base = _rss_kb()
    if mode == "full":
        logits = head(states)
        lp, ent = token_logprobs(logits, labels), token_entropy(logits)
    else:
        lp, ent = selected_logprobs(states, head, labels, torch.ones_like(labels, dtype=torch.bool),
                                    chunk_tokens=chunk, with_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    return {"peak_mb": (_peak_kb() - base) / 1024}


def _run_child(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per layout (the fastest counts)")
    parser.add_argument("--skip-logprob", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        kind, *rest = args.child
        print(json.dumps(child_update(*rest) if kind == "update" else child_logprob(*rest)))
        return 0
    print(f"load_average: {os.getloadavg()[0]:.2f}", flush=True)
    for name in args.settings.split(","):
        runs = {(layout, "memory"): _run_child("update", name, layout, "memory") for layout in ("rows", "packed")}
        timed: dict[str, list[dict]] = {"rows": [], "packed": []}
        for _ in range(max(1, args.repeats)):
            for layout in timed:
                timed[layout].append(_run_child("update", name, layout, "time"))
        rows, packed = ({**t[0], **{k: min(r[k] for r in t) for k in ("update_s", "logprob_s")}}
                        for t in (timed["rows"], timed["packed"]))
        lines = {"learner_tokens_rows": rows["tokens"], "learner_tokens_packed": packed["tokens"],
                 "packed_over_rows_tokens": packed["tokens"] / rows["tokens"],
                 "update_s_rows": rows["update_s"], "update_s_packed": packed["update_s"],
                 "update_s_packed_over_rows": packed["update_s"] / rows["update_s"],
                 "logprob_s_packed_over_rows": packed["logprob_s"] / rows["logprob_s"],
                 "peak_mem_rows_mb": runs[("rows", "memory")]["peak_mb"],
                 "peak_mem_packed_mb": runs[("packed", "memory")]["peak_mb"],
                 "peak_mem_packed_over_rows": runs[("packed", "memory")]["peak_mb"]
                 / runs[("rows", "memory")]["peak_mb"]}
        for key, value in lines.items():
            print(f"{key}@{name}: {value:.4g}" if isinstance(value, float) else f"{key}@{name}: {value}", flush=True)
    if not args.skip_logprob:
        full, chunked = _run_child("logprob", "full"), _run_child("logprob", "chunked")
        print(f"peak_mem_logprob_full_mb: {full['peak_mb']:.0f}")
        print(f"peak_mem_logprob_chunked_mb: {chunked['peak_mb']:.0f}")
        print(f"peak_mem_logprob_chunked_over_full: {chunked['peak_mb'] / full['peak_mb']:.3f}")
    print(f"load_average: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
