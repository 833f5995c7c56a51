"""The answer protocol a model was trained and evaluated under, written beside its exported weights so
that a server answers at budget B exactly as `anytime eval` scored it at B.

A trace cut at budget B continues with the close text and the answer header; a trace that closes its
thinking by itself continues with the header alone; the summary after the header is at most
`summary_max_tokens` long.

On vLLM the cut is shared between vLLM's own thinking budget and our logits processor
(`anytime.rollout.vllm.answer_processor`): the processor forces the close text's transition phrase (the
close text before its end marker: "...\n\n...\n\n"), then vLLM's budget runs out and vLLM forces its
`reasoning_end_str`, the end marker alone; the processor forces the header after any end marker. vLLM's
V1 model runner recognises the end of thinking only by the whole `reasoning_end_str`, so that string is
exactly what a natural end looks like: the end marker. vLLM counts a request's budget from the end of
the start marker `<think>`: the tokens the chat template puts after it (a newline in ours), the thinking
and the transition phrase. `request_budget(B)` is what a request sends to think for B generated tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anytime import defaults

log = logging.getLogger(__name__)

PROTOCOL_FILE = "anytime_protocol.json"
THINK_START = "<think>"


@dataclass(frozen=True)
class AnswerProtocol:
    think_start: str = THINK_START
    think_end: str = defaults.THINK_END
    close_text: str = defaults.CLOSE_TEXT
    header: str = defaults.HEADER
    summary_max_tokens: int = defaults.SUMMARY_MAX_TOKENS
    budgets: list[int] = field(default_factory=list)
    temperature: float = 0.6
    top_p: float = 0.95
    eos_ends_thinking: bool = False
    instruction: str = defaults.INSTRUCTION   # appended to every problem by the eval
    # tokens of the generation prompt after `think_start`, and of the close text's transition phrase,
    # both counted by vLLM's budget (see the module docstring); `measured` counts them on a tokenizer
    start_tokens_in_prompt: int = 1
    close_phrase_tokens: int = 4

    @classmethod
    def from_recipe(cls, recipe: Any, tokenizer: Any = None) -> AnswerProtocol:
        s = recipe.summary
        made = cls(think_end=s.think_end, close_text=s.close_text, header=s.header,
                   summary_max_tokens=s.max_tokens, budgets=list(recipe.eval.budgets or recipe.budget.grid()),
                   temperature=recipe.eval.temperature, top_p=recipe.eval.top_p,
                   eos_ends_thinking=s.eos_ends_thinking, instruction=recipe.data.instruction)
        return made.measured(tokenizer) if tokenizer is not None else made

    def measured(self, tokenizer: Any) -> AnswerProtocol:
        """This protocol with the token counts vLLM's budget includes measured on `tokenizer`; an error
        if vLLM's forced end would tokenise differently from the tokens `anytime eval` inserts."""
        check_split_tokenisation(tokenizer, self)
        start = thinking_start_marker(tokenizer)
        return dataclasses.replace(self, think_start=start, start_tokens_in_prompt=start_tokens_in_prompt(tokenizer, start),
                                   close_phrase_tokens=len(encode(tokenizer, self.close_phrase)))

    @property
    def close_phrase(self) -> str:
        """The close text before its end marker, which our processor forces before vLLM's forced end."""
        if not self.close_text.endswith(self.think_end):
            raise ValueError(f"the close text {self.close_text!r} does not end with the end marker {self.think_end!r}: "
                             "vLLM's thinking budget can only close the thinking with that marker")
        return self.close_text[:-len(self.think_end)]

    def request_budget(self, budget: int) -> int:
        """The `thinking_token_budget` a request sends to think for `budget` generated tokens."""
        return budget + self.start_tokens_in_prompt + self.close_phrase_tokens

    def reasoning_config(self) -> dict[str, str]:
        """vLLM's `--reasoning-config` (see the module docstring)."""
        return {"reasoning_start_str": self.think_start, "reasoning_end_str": self.think_end}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / PROTOCOL_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, folder: str | Path) -> AnswerProtocol | None:
        """The protocol saved in `folder`, or None when it holds none."""
        path = Path(folder) / PROTOCOL_FILE
        if not path.is_file():
            return None
        try:
            values = json.loads(path.read_text())
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"unknown keys {unknown}")
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not an anytime protocol file ({exc}); re-export the model with "
                             "`anytime export` or delete the file to serve with the defaults") from exc


def generation_prompt(tokenizer: Any) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False, add_generation_prompt=True)


def thinking_start_marker(tokenizer: Any) -> str:
    """The marker vLLM's budget counts from: `<think>` where the generation prompt opens the thinking with
    it, else the special (added) token that comes last in the generation prompt (`<|im_start|>` of the assistant
    turn, for chat models whose thinking starts right after the prompt). One token: vLLM's V1 runner
    miscounts a budget whose marker spans several."""
    prompt = generation_prompt(tokenizer)
    if THINK_START in prompt:
        return THINK_START
    added = {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()}   # tokens of their own
    special = [t for t in added if t and t in prompt]
    if not special:
        raise ValueError(f"the chat template's generation prompt ({prompt[-60:]!r}) holds neither {THINK_START!r} "
                         "nor a special token to count a thinking budget from")
    return max(special, key=prompt.rindex)


def start_tokens_in_prompt(tokenizer: Any, think_start: str = THINK_START) -> int:
    """Tokens the chat template's generation prompt puts after its last `think_start`."""
    prompt = generation_prompt(tokenizer)
    if think_start not in prompt:
        raise ValueError(f"the chat template's generation prompt does not hold {think_start!r} (it ends "
                         f"{prompt[-40:]!r}); vLLM's thinking budget counts from that marker")
    if len(encode(tokenizer, think_start)) != 1:
        raise ValueError(f"the start marker {think_start!r} is not one token: vLLM's V1 runner miscounts the budget")
    after = prompt[prompt.rindex(think_start) + len(think_start):]
    return len(encode(tokenizer, after)) if after else 0


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_split_tokenisation(tokenizer: Any, protocol: AnswerProtocol) -> None:
    """Served, a cut is tokenised as phrase | end marker | header; `anytime eval` inserts close text |
    header. Both give the same ids when the end marker is one token of its own."""
    served = (encode(tokenizer, protocol.close_phrase) + encode(tokenizer, protocol.think_end)
              + encode(tokenizer, protocol.header))
    evaluated = encode(tokenizer, protocol.close_text) + encode(tokenizer, protocol.header)
    if served != evaluated:
        raise ValueError(f"the end marker {protocol.think_end!r} merges with the text around it in this tokenizer "
                         f"({served} served vs {evaluated} evaluated): add it as a special token of its own")
