"""The answer protocol a model was trained and evaluated under, written beside its exported weights so
that a server answers at budget B exactly as `anytime eval` scored it at B.

The protocol holds the answer format (`anytime.config.answer_format.AnswerFormat`: a trace cut at budget B
continues with the close text and the answer header; a trace that closes its thinking by itself continues
with the header alone; the summary after the header is at most `summary_max_tokens` long) and adds what
serving needs besides: the eval's budgets and sampling, the instruction, and what vLLM's budget counts.
The file (`anytime_protocol.json`) keeps the format's keys flat beside the protocol's own, as files
written before the format was one value did.

On vLLM the cut is shared between vLLM's own thinking budget and our logits processor
(`anytime.serving.answer_processor`): the processor forces the close text's transition phrase (the
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
from anytime.config.answer_format import AnswerFormat, encode, eval_budgets

log = logging.getLogger(__name__)

PROTOCOL_FILE = "anytime_protocol.json"
THINK_START = "<think>"


@dataclass(frozen=True)
class AnswerProtocol:
    format: AnswerFormat = AnswerFormat()
    think_start: str = THINK_START
    budgets: list[int] = field(default_factory=list)
    temperature: float = 0.6
    top_p: float = 0.95
    instruction: str = defaults.INSTRUCTION   # appended to every problem by the eval
    # tokens of the generation prompt after `think_start`, and of the close text's transition phrase,
    # both counted by vLLM's budget (see the module docstring); `measured` counts them on a tokenizer
    start_tokens_in_prompt: int = 1
    close_phrase_tokens: int = 4

    @classmethod
    def from_recipe(cls, recipe: Any, tokenizer: Any = None) -> AnswerProtocol:
        made = cls(AnswerFormat.from_recipe(recipe), budgets=eval_budgets(recipe), temperature=recipe.eval.temperature,
                   top_p=recipe.eval.top_p, instruction=recipe.data.instruction)
        return made.measured(tokenizer) if tokenizer is not None else made

    def measured(self, tokenizer: Any) -> AnswerProtocol:
        """This protocol with the token counts vLLM's budget includes measured on `tokenizer`; an error
        if vLLM's forced end would tokenise differently from the tokens `anytime eval` inserts
        (`AnswerFormat.check_tokenisation`)."""
        self.format.check_tokenisation(tokenizer)
        start = thinking_start_marker(tokenizer)
        return dataclasses.replace(self, think_start=start, start_tokens_in_prompt=start_tokens_in_prompt(tokenizer, start),
                                   close_phrase_tokens=len(encode(tokenizer, self.format.close_phrase)))

    def request_budget(self, budget: int) -> int:
        """The `thinking_token_budget` a request sends to think for `budget` generated tokens."""
        return budget + self.start_tokens_in_prompt + self.close_phrase_tokens

    def reasoning_config(self) -> dict[str, str]:
        """vLLM's `--reasoning-config` (see the module docstring)."""
        return {"reasoning_start_str": self.think_start, "reasoning_end_str": self.format.think_end}

    def to_json(self) -> str:
        """The file's flat keys: the format's, then the protocol's own."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "format"}
        return json.dumps({**dataclasses.asdict(self.format), **own}, indent=2) + "\n"

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
            format_keys = {f.name for f in dataclasses.fields(AnswerFormat)}
            own_keys = {f.name for f in dataclasses.fields(cls)} - {"format"}
            unknown = sorted(set(values) - format_keys - own_keys)
            if unknown:
                raise ValueError(f"unknown keys {unknown}")
            answer_format = AnswerFormat(**{k: v for k, v in values.items() if k in format_keys})
            return cls(answer_format, **{k: v for k, v in values.items() if k in own_keys})
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
