"""Values that must mean one thing everywhere: the paper's rollout defaults (AnytimeReasoner §1,
R1-Distill models) and the dtype names recipes and the CLI accept. Recipes, the eval CLI, the
rollout settings and the synthetic task all read them from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from anytime.registry import Registry

if TYPE_CHECKING:
    import torch

THINK_END = "</think>"
# Appended after a thinking trace cut at a budget (never trained), then the answer header. The
# official code's text: its first "..." runs straight on from the cut tokens; the R1-distilled
# models the paper trains have seen exactly this.
CLOSE_TEXT = "...\n\n...\n\n</think>"
HEADER = "\n\n**Final Answer**\n"
# The paper caps a summary at 128 tokens, of which the inserted close/header take about 10.
SUMMARY_MAX_TOKENS = 118
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# Training problems generated for a procedural task (`data.task_size`); the held-out eval of the
# same task is checked disjoint from exactly these.
TASK_SIZE = 4000

DTYPES = Registry("model.dtype", {name: f"torch:{name}" for name in ("float32", "bfloat16", "float16", "float64")},
                  doc="the model's weights and compute dtype")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a recipe dtype name; an error naming the allowed ones otherwise."""
    return DTYPES.get(name)
