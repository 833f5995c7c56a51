"""Supervised warm start: teach a model the task's format and reasoning before RL.

Trains on (prompt, reference completion) pairs with cross-entropy on the completion tokens only.
The quickstart uses it on the synthetic task, whose reference traces include filler lines, so the
warm-started policy reasons verbosely — room for anytime RL to improve. On a procedural task
(`data.train: reasoning_gym:<task>`) the references are the task's worked solutions
(`anytime.tasks.worked`) of the training split's problems.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from anytime.config import Recipe
from anytime.data.prompts import render_prompt
from anytime.data.sources import SYNTHETIC, TASK, source_kind
from anytime.learner.lr_schedules import lr_lambda
from anytime.tasks.synthetic import make_problems, sft_completion

log = logging.getLogger(__name__)


def sft_pair(tokenizer, problem: str, instruction: str, completion: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids ending on EOS): the completion is what the loss trains."""
    ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return render_prompt(tokenizer, problem, instruction), ids


def synthetic_sft_pairs(recipe: Recipe, tokenizer, size: int, seed: int) -> list[tuple[list[int], list[int]]]:
    d, s = recipe.data, recipe.summary
    rng = random.Random(seed)
    return [sft_pair(tokenizer, p.problem, d.instruction,
                     sft_completion(p, rng, d.synthetic_filler, s.think_end, s.header, d.synthetic_whole_sums))
            for p in make_problems(size, seed, d.synthetic_min_ops, d.synthetic_max_ops)]


def task_sft_pairs(recipe: Recipe, tokenizer) -> list[tuple[list[int], list[int]]]:
    """The training split of a procedural task (the problems RL trains on and the held-out split
    avoids), each with its worked solution as the thinking."""
    from anytime.data.task_splits import train_task_rows
    from anytime.tasks.reasoning_gym import decode_entry, task_name
    from anytime.tasks.worked import warm_start_completion, worked_solution

    d, s = recipe.data, recipe.summary
    pairs = []
    for row in train_task_rows(d.train, d.task_config, d.task_size, recipe.trainer.seed):
        entry = decode_entry(row.answer["entry"])
        completion = warm_start_completion(worked_solution(task_name(d.train), entry), str(entry["answer"]),
                                           s.think_end, s.header)
        pairs.append(sft_pair(tokenizer, row.problem, d.instruction, completion))
    return pairs


def sft_pairs(recipe: Recipe, tokenizer) -> list[tuple[list[int], list[int]]]:
    kind = source_kind(recipe.data.train)
    if kind == SYNTHETIC:
        return synthetic_sft_pairs(recipe, tokenizer, recipe.data.synthetic_size, recipe.trainer.seed + 17)
    if kind == TASK:
        return task_sft_pairs(recipe, tokenizer)
    raise ValueError("the supervised warm start (sft.steps > 0) is built for data.train: synthetic or a procedural "
                     "task (reasoning_gym:<task> with worked solutions); set sft.steps: 0 for other datasets")


@dataclass(frozen=True)
class SftPlacement:
    device: torch.device   # the learner's (`cuda:LOCAL_RANK` on a GPU machine): the other ranks wait for it
    dtype: torch.dtype     # of the weights and the compute: float32, also for bf16 recipes (no bf16 anywhere,
                           # so no device is slowed by it); float64 when asked (exactness tests)


def sft_placement(recipe: Recipe) -> SftPlacement:
    """Where and in what precision the warm start trains: on the learner's device, in float32 (float64
    when the recipe's weights are)."""
    from anytime.learner.factory import learner_device

    return SftPlacement(learner_device(), torch.float64 if recipe.model.dtype == "float64" else torch.float32)


def run_sft(recipe: Recipe, model_path: str, out_dir: str | Path) -> Path:
    """Fine-tune `model_path` on the recipe's SFT data and save a Hugging Face folder to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = recipe.sft
    torch.manual_seed(recipe.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    place = sft_placement(recipe)
    device = place.device
    log.info("supervised warm start on %s in %s", device, str(place.dtype).removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=place.dtype).to(device)
    pairs = sft_pairs(recipe, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, cfg.steps))
    rng = random.Random(recipe.trainer.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    start, cpu_start, last_loss = time.perf_counter(), time.process_time(), float("nan")
    losses: list[float] = []  # every step's loss, written next to the model: the curve tells a failed start from a slow one
    for step in range(cfg.steps):
        batch = rng.sample(pairs, min(cfg.batch_size, len(pairs)))
        T = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), T), pad, dtype=torch.long)
        labels = torch.full((len(batch), T), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), T), dtype=torch.long)
        for i, (p, c) in enumerate(batch):
            seq = p + c
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p): len(seq)] = torch.tensor(c)
            attn[i, : len(seq)] = 1
        loss = model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss = float(loss.detach())
        losses.append(last_loss)
        if step % 100 == 0 or step == cfg.steps - 1:
            log.info("sft step %d/%d loss %.4f (%.0fs)", step + 1, cfg.steps, last_loss, time.perf_counter() - start)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # CPU seconds beside wall seconds: on a shared machine only the former compares two runs
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    (tmp / "sft_loss.json").write_text(json.dumps({"steps": cfg.steps, "seconds": seconds, "cpu_seconds": cpu_seconds,
                                                   "loss": losses}))
    (tmp / "sft_done.txt").write_text(f"steps={cfg.steps} final_loss={last_loss:.4f}\n")
    if device.type == "cuda":   # the learner and an engine on this GPU come next
        del model, optimizer
        torch.cuda.empty_cache()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
