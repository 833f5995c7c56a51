"""The answer format (`AnswerFormat`): how a thinking trace ends and its answer follows, one immutable
value validated once, which the recipe checks, the rollout settings, the eval options and the serving
protocol hold rather than copy.

A trace that closes its thinking by itself is followed by the header; a trace cut at a budget by the
close text, then the header; the summary after the header is at most `summary_max_tokens` long. With
`eos_ends_thinking` (instruct models) a trace that stops on EOS has ended its thinking.

Also the values derived from it that several places need: the tokens a summary needs after a cut
(`summary_room`, `AnswerFormat.room_after_cut`) and the budgets a recipe is evaluated and served at
(`eval_budgets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from anytime import defaults
from anytime.errors import RecipeError


def encode(tokenizer: Any, text: str) -> list[int]:
    """`text`'s token ids as inserted into a sequence: no special tokens added."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def summary_room(inserted_tokens: int, summary_max_tokens: int) -> int:
    """The tokens a summary request adds after the cut: what is inserted there (close + header, or
    the header alone after a natural end), then the summary."""
    return inserted_tokens + summary_max_tokens


class FormatIds(NamedTuple):
    """The format's text as token ids of one tokenizer."""

    think_end: int            # the end marker: one token
    close: tuple[int, ...]    # inserted after a cut, before the header
    header: tuple[int, ...]


@dataclass(frozen=True)
class AnswerFormat:
    """The recipe's `summary.*` format keys as one value: its rules are checked here, once."""

    think_end: str = defaults.THINK_END
    close_text: str = defaults.CLOSE_TEXT
    header: str = defaults.HEADER
    summary_max_tokens: int = defaults.SUMMARY_MAX_TOKENS
    eos_ends_thinking: bool = False   # instruct models: EOS closes the thinking (see the rollout runner)

    def __post_init__(self) -> None:
        if not self.think_end.strip():
            raise RecipeError(f"`summary.think_end` must be the model's end-of-thinking marker such as "
                              f"{defaults.THINK_END!r}, got {self.think_end!r}")
        # Served, vLLM's thinking budget closes a cut by forcing the end marker itself after the text
        # before it (`anytime.serving.protocol`), so nothing can follow the marker; and the verifier reads
        # the answer from the one end marker on.
        if not self.close_text.endswith(self.think_end) or self.close_text.count(self.think_end) != 1:
            moved = self.close_text.replace(self.think_end, "") + self.think_end
            raise RecipeError(
                f"`summary.close_text` {self.close_text!r} must end with `summary.think_end` {self.think_end!r} and "
                "hold it only there: a served model's cut is closed by vLLM forcing that marker after the close text, "
                f"so nothing can follow it; e.g. set summary.close_text={moved!r} and put any text after the marker "
                "into `summary.header`")
        if not self.header.strip():
            raise RecipeError(f"`summary.header` must not be blank, got {self.header!r}; the verifier looks for it")
        if self.summary_max_tokens <= 0:
            raise RecipeError(f"`summary.max_tokens` must be a positive integer, got {self.summary_max_tokens}")

    @classmethod
    def from_recipe(cls, recipe: Any) -> AnswerFormat:
        """The format of a recipe's `summary` section (recipe: an `anytime.config.Recipe`)."""
        s = recipe.summary
        return cls(think_end=s.think_end, close_text=s.close_text, header=s.header, summary_max_tokens=s.max_tokens,
                   eos_ends_thinking=s.eos_ends_thinking)

    @property
    def close_phrase(self) -> str:
        """The close text before its end marker: what a server forces before vLLM forces the marker."""
        return self.close_text[:-len(self.think_end)]

    @property
    def verifier_header(self) -> str:
        """The header as the verifier matches it: surrounding whitespace stripped."""
        return self.header.strip()

    def think_end_id(self, tokenizer: Any) -> int:
        """The end marker's one token id; an error naming the key if it is not one token."""
        ids = encode(tokenizer, self.think_end)
        if len(ids) != 1:
            raise RecipeError(f"`summary.think_end` {self.think_end!r} is {len(ids)} tokens for this tokenizer; the "
                              "end marker must be one token (set summary.think_end to the model's own marker)")
        return ids[0]

    def ids(self, tokenizer: Any) -> FormatIds:
        return FormatIds(self.think_end_id(tokenizer), tuple(encode(tokenizer, self.close_text)),
                         tuple(encode(tokenizer, self.header)))

    def room_after_cut(self, tokenizer: Any) -> int:
        """The most tokens a summary request adds after a cut: close + header + summary."""
        inserted = len(encode(tokenizer, self.close_text)) + len(encode(tokenizer, self.header))
        return summary_room(inserted, self.summary_max_tokens)

    def check_tokenisation(self, tokenizer: Any) -> None:
        """What serving needs of `tokenizer`: the end marker is one token, and a served cut, tokenised as
        phrase | end marker | header (vLLM forces the marker alone), gives the ids `anytime eval` and
        training insert, close text | header."""
        self.think_end_id(tokenizer)
        header = encode(tokenizer, self.header)
        served = encode(tokenizer, self.close_phrase) + encode(tokenizer, self.think_end) + header
        inserted = encode(tokenizer, self.close_text) + header
        if served != inserted:
            raise RecipeError(f"`summary.think_end` {self.think_end!r} merges with the text around it in this "
                              f"tokenizer ({served} served vs {inserted} inserted by the rollout): add it as a special "
                              "token of its own, or change `summary.close_text` / `summary.header`")


def eval_budgets(recipe: Any) -> list[int]:
    """The budgets a recipe's model is evaluated (in training and by `anytime eval --recipe`) and served
    at: `eval.budgets`, else the training grid."""
    budgets: Sequence[int] = recipe.eval.budgets or recipe.budget.grid()
    return list(budgets)
