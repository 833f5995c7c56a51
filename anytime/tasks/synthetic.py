"""A synthetic reasoning task for the CPU quickstart, where longer thinking really helps.

Each problem is a chain of single-digit additions modulo 10 ("Start with 3. Step 1: add 7. Step 2:
add 2. What is the last digit of the result?"). The reference thinking trace works through the
chain one numbered line per step ("1: 3+7=0"), so a trace cut early has only a partial result:
accuracy rises with the budget. Numbered steps make the operand lookup a plain match (find
"Step k" in the prompt), which a small transformer learns quickly.
With whole sums ("1: 8+5=13", `data.synthetic_whole_sums`) the digit that carries depends on each
operand alone, so a small model gets a gradient toward adding from its first steps; with the last
digit only, neither operand alone says anything about the result, and a warm start can sit on a
plateau for hundreds of steps before it learns to add.
Reference traces also carry filler lines ("hmm, let me check.") with a given probability, as
verbose reasoning models do; a policy that learns to drop them reaches the answer at smaller
budgets, which is exactly what the anytime objective rewards. Rows use the math data format
(problem, answer) and the answer is graded by the same verifier.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from anytime import defaults

FILLER_LINES = ("hmm, let me check.", "wait, go on.", "ok, next one.")


@dataclass(frozen=True)
class ChainProblem:
    start: int
    operands: tuple[int, ...]

    @property
    def answer(self) -> int:
        return (self.start + sum(self.operands)) % 10

    @property
    def problem(self) -> str:
        steps = " ".join(f"Step {k}: add {x}." for k, x in enumerate(self.operands, 1))
        return f"Start with {self.start}. {steps} What is the last digit of the result?"

    def thinking(self, rng: random.Random | None = None, filler: float = 0.0, whole_sums: bool = False) -> str:
        """Reference reasoning: one line per step, each possibly preceded by a filler line. With
        `whole_sums` a line writes the step's whole sum ("1: 8+5=13") and the next line goes on from its
        last digit; otherwise only the last digit ("1: 8+5=3")."""
        lines, value = [], self.start
        for k, x in enumerate(self.operands, 1):
            if rng is not None and rng.random() < filler:
                lines.append(rng.choice(FILLER_LINES))
            total = value + x
            lines.append(f"{k}: {value}+{x}={total if whole_sums else total % 10}")
            value = total % 10
        return "\n".join(lines) + "\n"


def make_problems(size: int, seed: int, min_ops: int = 3, max_ops: int = 6) -> list[ChainProblem]:
    if size <= 0 or min_ops < 1 or max_ops < min_ops:
        raise ValueError(f"bad synthetic task sizes: size={size}, ops in [{min_ops}, {max_ops}]")
    rng = random.Random(seed)
    return [ChainProblem(rng.randrange(10), tuple(rng.randrange(1, 10) for _ in range(rng.randint(min_ops, max_ops))))
            for _ in range(size)]


def sft_completion(problem: ChainProblem, rng: random.Random, filler: float, think_end: str = defaults.THINK_END,
                   header: str = defaults.HEADER, whole_sums: bool = False) -> str:
    """The assistant text after the `<think>\\n` generation prompt: thinking, close, answer."""
    return f"{problem.thinking(rng, filler, whole_sums)}{think_end}{header}\\boxed{{{problem.answer}}}"


def corpus(size: int = 2000, seed: int = 12345) -> list[str]:
    """Text to train the tiny model's tokenizer on: problems, traces, answers, instructions."""
    rng = random.Random(seed)
    texts = []
    for p in make_problems(size, seed, 1, 8):
        texts.append(p.problem + " " + defaults.INSTRUCTION)
        texts.append(sft_completion(p, rng, 0.5) + "\n\n...\n\n")
    return texts
