"""The engine/learner log-prob gap in each `rollout.logprobs` mode, at a recipe's temperature and top-p.

Both engines sample the same prompts with the same seeds twice, once returning raw log-probs and once
processed ones (after temperature and top-p); the learner's log-probs of those tokens come from its own
path (hidden states through the LM head in chunks, `anytime.algo.logprobs.selected_logprobs`), raw and
under the same processing. Prints `name: value` lines, mean (and max) |engine - learner| per token:

  gap_ENGINE_raw        engine raw, learner raw (the default mode)
  gap_ENGINE_processed  engine processed, learner processed (`rollout.logprobs: processed`)
  raw_to_sampled_ENGINE engine raw against the distribution the token was drawn from (what an
                        importance weight built on raw log-probs gets wrong)

The mode with the smaller gap is the better default: the off-policy correction and PPO's ratio divide
the learner's probability by the engine's.

Usage: python benchmarks/logprob_gap.py [--recipe recipes/smollm2_reasoning.yaml] [--model DIR]
                                        [--engines hf,vllm] [--temperature T] [--top-p P] [--prompts 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is 3 + 4?", "What is 7 + 2?", "What is 5 + 5?", "What is 9 + 0?", "What is 1 + 8?",
             "What is 6 + 3?", "What is 2 + 2?", "What is 4 + 1?"]


def learner_logprobs(model, prompt: list[int], tokens: list[int], processing) -> torch.Tensor:
    from anytime.algo.logprobs import selected_logprobs

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
        labels = ids[:, 1:]
        select = torch.zeros_like(labels, dtype=torch.bool)
        select[:, len(prompt) - 1:] = True
        per_token = None if processing is None else processing.per_token(select, torch.zeros_like(select))
        lp, _ = selected_logprobs(hidden, model.get_output_embeddings(), labels, select, processing=per_token)
    return lp[0, len(prompt) - 1:].double()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2_reasoning.yaml"))
    parser.add_argument("--model", default=None, help="default: the recipe's model.path")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--temperature", type=float, default=None, help="default: the recipe's rollout.temperature")
    parser.add_argument("--top-p", type=float, default=None, help="default: the recipe's rollout.top_p")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from anytime.algo.logprobs import SamplingProcessing
    from anytime.config import load_recipe
    from anytime.data.prompts import render_prompt
    from anytime.rollout.engines.engine import SamplingConfig, create_engine

    recipe = load_recipe(args.recipe)
    model_dir = args.model or str(REPO / recipe.model.path)
    temperature = recipe.rollout.temperature if args.temperature is None else args.temperature
    top_p = recipe.rollout.top_p if args.top_p is None else args.top_p
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [render_prompt(tokenizer, q, recipe.data.instruction) for q in (QUESTIONS * args.prompts)[:args.prompts]]
    sampling = SamplingConfig(max_new_tokens=args.max_tokens, n=2, temperature=temperature, top_p=top_p, seed=0)
    processing = SamplingProcessing(temperature, top_p, temperature, top_p)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    max_len = max(map(len, prompts)) + args.max_tokens
    print(f"temperature: {temperature}")
    print(f"top_p: {top_p}")
    for kind in args.engines.split(","):
        samples = {}
        for mode in ("raw", "processed"):
            with create_engine(kind, model_dir, max_model_len=max_len, logprobs=mode) as engine:
                samples[mode] = engine.generate(prompts, sampling)
        gaps: dict[str, list[torch.Tensor]] = {"raw": [], "processed": [], "raw_to_sampled": []}
        for prompt, raw, processed in zip(prompts, samples["raw"], samples["processed"]):
            for r, p in zip(raw, processed):
                raw_lp, sampled_lp = (torch.tensor(c.logprobs, dtype=torch.float64) for c in (r, p))
                gaps["raw"].append((raw_lp - learner_logprobs(model, prompt, r.token_ids, None)).abs())
                gaps["processed"].append((sampled_lp - learner_logprobs(model, prompt, p.token_ids, processing)).abs())
                if r.token_ids == p.token_ids:   # the same seeds: the same tokens, only the reported log-prob differs
                    gaps["raw_to_sampled"].append((raw_lp - sampled_lp).abs())
        for name, parts in gaps.items():
            values = torch.cat(parts) if parts else torch.zeros(1, dtype=torch.float64)
            label = f"gap_{kind}_{name}" if name != "raw_to_sampled" else f"raw_to_sampled_{kind}"
            print(f"{label}: {float(values.mean()):.3g}")
            print(f"{label}_max: {float(values.max()):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
