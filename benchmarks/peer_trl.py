"""A peer: TRL's GRPOTrainer next to our GRPO and BRPO, on the CPU quickstart or on a real model.

Warm-starts the quickstart's tiny model once (its SFT stage), then trains three policies from it
with the same prompts in the same order (8 prompts × 8 completions a step), the same optimiser
settings and the same number of steps:
  - ours, GRPO: `recipes/paper/grpo.yaml`'s knobs on the quickstart (one budget = the largest,
    summary.n = 1, the grpo estimator, prior base);
  - ours, BRPO: the quickstart itself;
  - TRL's `GRPOTrainer` (generation with transformers on the CPU, `use_vllm=False`), rewarded by our
    verifier on its completions, with the same token room as ours: the largest budget + the inserted
    close and header + the summary tokens.
Each final model is scored by our held-out evaluation (the quickstart's: budgets 16/32/48/64, 200
synthetic problems × 8 traces sampled at temperature 0.6, top-p 0.95). Seconds per step are means over the steps after the first (the first
warms caches up), one thread each, the rollout included.

With `--recipe recipes/smollm2_reasoning.yaml` (a real model: SmolLM2-135M-Instruct on one-digit sums,
vLLM rollouts) there is no warm start: all three start from the recipe's model with its batch
(8 prompts × 8 completions), optimiser, trained layers (`learner.trainable_layers`, frozen alike in
TRL's model), bf16 autocast, temperature and steps, the threads of the recipe (`trainer.num_threads`).
TRL generates with transformers and has no budget cut or forced summary, so its reward is the task's
own scorer on the completion's final answer (its last `\boxed{}`, else its last number); ours score
the forced summaries. All are scored afterwards by the recipe's own held-out eval.

Prints ``name: value`` lines: s_per_step_ours_grpo, s_per_step_ours_brpo, s_per_step_trl_grpo,
trl_over_ours (TRL's s/step ÷ our GRPO's), anytime_sft (the start: the warm start, or the real model),
anytime_ours_grpo, anytime_ours_brpo, anytime_trl_grpo.

Needs TRL (an optional extra: pip install -e '.[peer]').
    python benchmarks/peer_trl.py [--steps 40] [--work runs/peer_trl] [--warm-start DIR] [--only ours_grpo,ours_brpo,trl_grpo]
    python benchmarks/peer_trl.py --recipe recipes/smollm2_reasoning.yaml --steps 20 --only ours_grpo,trl_grpo
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")
OURS = ("ours_grpo", "ours_brpo")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

sys.path.insert(0, str(REPO))  # run as a script from anywhere


def eval_budgets(recipe: Any) -> str:
    """Every run is scored on the recipe's training grid (GRPO trains on its largest budget only)."""
    return f"eval.budgets=[{','.join(str(b) for b in recipe.budget.grid())}]"


def variant(name: str, recipe: Any) -> list[str]:
    """Our GRPO (one budget, the largest; one summary; GRPO's std-scaled group advantages, as TRL's
    scale_rewards="group") or BRPO (the recipe itself)."""
    if name == "ours_brpo":
        return []
    return [f"budget.budgets=[{recipe.budget.grid()[-1]}]", "budget.prior=base", "summary.n=1",
            "summary.estimator=grpo", "algorithm.estimator=grpo"]


def run_ours(name: str, start: str, args: argparse.Namespace) -> dict[str, float]:
    """One of our runs, in its own process (`anytime train`), from the shared start."""
    from anytime.config import load_recipe

    recipe = load_recipe(args.recipe)
    run_dir = Path(args.work) / name
    overrides = [f"trainer.seed={args.seed}", "logging.progress=false", f"model.path={start}", "model.tiny=false",
                 "sft.steps=0", f"trainer.steps={args.steps}", f"trainer.output_dir={run_dir}",
                 "trainer.resume=never", "trainer.save_every=100000", eval_budgets(recipe), *variant(name, recipe)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.recipe == QUICKSTART:
        env["OMP_NUM_THREADS"] = "1"
    subprocess.run([sys.executable, "-m", "anytime.cli", "train", args.recipe, *overrides], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [m["time/step"] for m in steps if "time/step" in m]
    history = json.loads((run_dir / "final_eval.json").read_text())
    return {"s_per_step": statistics.mean(times[1:] or times), "anytime": history["after"]["eval/anytime"],
            "anytime_before": history["before"]["eval/anytime"]}


def step_prompts(recipe: Any, steps: int) -> list[Any]:
    """The rows our trainer rolls out, in its order."""
    from anytime.data.sources import load_train_rows
    from anytime.trainer.trainer import step_row_indices

    rows, n = load_train_rows(recipe), recipe.rollout.prompts_per_step
    return [rows[i] for step in range(steps) for i in step_row_indices(step, n, len(rows))]


def final_answer(completion: str, think_end: str, header: str) -> str:
    """A completion without a thinking format as our verifier reads a summary: its last `\\boxed{}`
    (else its last number) after the end of thinking and the header."""
    boxed = completion.rfind("\\boxed{")
    if boxed >= 0:
        return f"{think_end}\n\n{header}\n{completion[boxed:]}"
    numbers = NUMBER.findall(completion)
    return f"{think_end}\n\n{header}\n\\boxed{{{numbers[-1] if numbers else ''}}}"


def run_trl(sft_path: str, args: argparse.Namespace) -> dict[str, float]:
    """TRL's GRPOTrainer on the same prompts, optimiser and token room; our verifier as its reward."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from anytime.config import load_recipe
    from anytime.data.prompts import render_prompt, user_message
    from anytime.reward.verifier import RewardScorer
    from anytime.rollout.settings import engine_max_len

    recipe = load_recipe(args.recipe, [f"trainer.seed={args.seed}"])
    torch.set_num_threads(1 if args.recipe == QUICKSTART else recipe.trainer.num_threads)
    tok = AutoTokenizer.from_pretrained(sft_path)
    rows = step_prompts(recipe, args.steps)
    messages = [[{"role": "user", "content": user_message(r.problem, recipe.data.instruction)}] for r in rows]
    # TRL renders conversational prompts with the chat template, as our trainer does: check it.
    assert tok.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"] == render_prompt(tok, rows[0].problem, recipe.data.instruction)
    s = recipe.summary
    room = engine_max_len(recipe, tok) - recipe.data.max_prompt_len  # thinking + inserted close and header + summary
    eos = {tok.eos_token_id}
    scorer = RewardScorer(header=s.header.strip(), think_end=s.think_end)

    def verifier_reward(prompts: list, completions: list, completion_ids: list[list[int]], answer: list,
                        **_: Any) -> list[float]:
        # Decode the ids: TRL's texts drop special tokens, `</think>` among them.
        texts = [tok.decode([t for t in ids if t not in eos], skip_special_tokens=False) for ids in completion_ids]
        if not any(s.think_end in t for t in texts):   # an instruct model: no thinking format
            texts = [final_answer(t, s.think_end, s.header.strip()) for t in texts]
        return [v.score for v in scorer.score(texts, [rows[i].answer for i in answer])]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    from anytime.core.precision import bf16_enabled, native_bf16

    learner, timer = recipe.learner, StepTimes()
    n = recipe.rollout.n
    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl_grpo"), max_steps=args.steps, seed=args.seed, use_cpu=True,
        per_device_train_batch_size=recipe.rollout.prompts_per_step * n, num_generations=n,
        gradient_accumulation_steps=1, num_iterations=1, shuffle_dataset=False,
        max_completion_length=room, temperature=recipe.rollout.temperature, top_p=recipe.rollout.top_p, top_k=0,
        learning_rate=learner.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=learner.weight_decay,
        adam_beta1=learner.betas[0], adam_beta2=learner.betas[1], max_grad_norm=learner.grad_clip,
        beta=0.0, epsilon=recipe.algorithm.clip_low, epsilon_high=recipe.algorithm.clip_high,
        loss_type="dapo",  # token-mean over the batch, as recipe algorithm.loss_agg=token-mean
        scale_rewards="group", use_vllm=False, logging_steps=1, save_strategy="no", report_to="none",
        bf16=bf16_enabled(learner.bf16, native_bf16("cpu")),   # our learner's resolution of `auto`
        dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32)
    if learner.trainable_layers:
        from anytime.learner.freeze import train_top_layers

        train_top_layers(model, learner.trainable_layers)
    # the gold travels as the row's index (a procedural task's gold is not a dataset value)
    dataset = Dataset.from_list([{"prompt": m, "answer": i} for i, m in enumerate(messages)])
    trainer = GRPOTrainer(model=model, reward_funcs=verifier_reward, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[timer])
    try:
        trainer.train()
    finally:
        scorer.close()
    out = Path(args.work) / "trl_grpo" / "final"
    trainer.save_model(str(out))
    tok.save_pretrained(str(out))
    return {"s_per_step": statistics.mean(timer.times[1:] or timer.times), "anytime": evaluate(str(out), args)}


def evaluate(model_path: str, args: argparse.Namespace) -> float:
    """Our held-out anytime score of a model: the quickstart's evaluation, as our runs do it."""
    from transformers import AutoTokenizer

    from anytime.config import load_recipe
    from anytime.config.placement_plan import placement_plan
    from anytime.evaluation.in_training import evaluate_on_worker
    from anytime.rollout.workers.worker import RolloutWorker

    recipe = load_recipe(args.recipe, [f"trainer.seed={args.seed}", f"model.path={model_path}", "model.tiny=false"])
    recipe = load_recipe(args.recipe, [f"trainer.seed={args.seed}", f"model.path={model_path}", "model.tiny=false",
                                       eval_budgets(recipe)])
    tok = AutoTokenizer.from_pretrained(model_path)
    worker = RolloutWorker(recipe, placement_plan(recipe), model_path, tok)
    try:
        return worker.apply(evaluate_on_worker)[0]["eval/anytime"]
    finally:
        worker.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=QUICKSTART,
                        help="the quickstart (a warm start first) or a real-model recipe such as "
                             "recipes/smollm2_reasoning.yaml (from its model)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", default="runs/peer_trl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="ours_grpo,ours_brpo,trl_grpo")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default: the quickstart's)")
    parser.add_argument("--warm-start", default=None,
                        help="a warm-started model folder to start from (e.g. runs/ablation/seed0/warm_start/sft_model) "
                             "instead of running the quickstart's SFT stage")
    args = parser.parse_args()
    only = [x for x in args.only.split(",") if x]
    if "trl_grpo" in only:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            parser.error("TRL is not installed: pip install -e '.[peer]' (or leave trl_grpo out of --only)")
    if Path(args.recipe).resolve() == Path(QUICKSTART):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from anytime.config import load_recipe
    from anytime.trainer.launch import prepare_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sft = [] if args.sft_steps is None else [f"sft.steps={args.sft_steps}"]
    args.recipe = str(Path(args.recipe).resolve())
    recipe = load_recipe(args.recipe)
    if args.recipe != QUICKSTART:
        sft_path = recipe.model.path
    else:
        sft_path = args.warm_start or prepare_model(load_recipe(QUICKSTART, [
            f"trainer.seed={args.seed}", "logging.progress=false", f"trainer.output_dir={work}/shared",
            f"model.path={work}/shared/init_model", *sft]))
    results = {name: run_ours(name, sft_path, args) for name in OURS if name in only}
    if "trl_grpo" in only:
        results["trl_grpo"] = run_trl(sft_path, args)
    for name, r in results.items():
        print(f"s_per_step_{name}: {r['s_per_step']:.3f}")
    if "trl_grpo" in results and "ours_grpo" in results:
        print(f"trl_over_ours: {results['trl_grpo']['s_per_step'] / results['ours_grpo']['s_per_step']:.2f}")
    before = next((r["anytime_before"] for r in results.values() if "anytime_before" in r), None)
    if before is not None:
        print(f"anytime_sft: {before:.3f}")
    for name, r in results.items():
        print(f"anytime_{name}: {r['anytime']:.3f}")
    (work / "results.json").write_text(json.dumps({"steps": args.steps, "seed": args.seed, "results": results},
                                                  indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
