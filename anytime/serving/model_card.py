"""What an exported folder carries besides its weights, so that it is served as it was evaluated: the
answer protocol (`anytime_protocol.json`), the eval's sampling settings in `generation_config.json`,
and a model card (`README.md`) with the run's anytime eval table, the command that serves the folder and
a request at a budget to paste."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from anytime.serving.protocol import AnswerProtocol

ACCURACY_KEY = re.compile(r"eval/(?P<bench>.+)/acc@(?P<budget>\d+)$")


def run_folder_of(ckpt: Path) -> Path | None:
    """The run folder of a checkpoint (`RUN/checkpoints/step_N`), found by its saved `recipe.yaml`."""
    for folder in (ckpt, *ckpt.parents[:3]):
        if (folder / "recipe.yaml").is_file():
            return folder
    return None


def protocol_for(ckpt: Path, tokenizer: Any) -> tuple[AnswerProtocol, Path | None]:
    """The protocol of the run that wrote `ckpt` (its recipe), or the defaults outside a run."""
    run = run_folder_of(ckpt)
    if run is None:
        return AnswerProtocol().measured(tokenizer), None
    from anytime.config import load_recipe

    return AnswerProtocol.from_recipe(load_recipe(run / "recipe.yaml"), tokenizer), run


def accuracy_table(final_eval: dict[str, Any]) -> str:
    """Markdown: accuracy per benchmark and budget, before and after RL (the run's final_eval.json)."""
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for phase in ("before", "after"):
        for key, value in (final_eval.get(phase) or {}).items():
            m = ACCURACY_KEY.match(key)
            if m:
                cells.setdefault((m["bench"], int(m["budget"])), {})[phase] = value
    if not cells:
        return ""
    lines = ["| benchmark | budget | accuracy before RL | accuracy after RL |", "|---|---:|---:|---:|"]
    for (bench, budget), v in sorted(cells.items()):
        fmt = ["—" if v.get(p) is None else f"{v[p]:.3f}" for p in ("before", "after")]
        lines.append(f"| {bench} | {budget} | {fmt[0]} | {fmt[1]} |")
    return "\n".join(lines)


def model_card(name: str, protocol: AnswerProtocol, run: Path | None) -> str:
    budgets = protocol.budgets or [256, 1024]
    b, answer_format = budgets[0], protocol.format
    table = ""
    if run is not None and (run / "final_eval.json").is_file():
        table = accuracy_table(json.loads((run / "final_eval.json").read_text()))
    problem = f"What is 17 * 23? {protocol.instruction}".strip()
    request = json.dumps({"model": name, "messages": [{"role": "user", "content": problem}],
                          "thinking_token_budget": protocol.request_budget(b),
                          "max_tokens": protocol.request_budget(b) + 16 + answer_format.summary_max_tokens,
                          "temperature": protocol.temperature, "top_p": protocol.top_p,
                          "skip_special_tokens": False})
    rows = "\n".join(f"| {x} | {protocol.request_budget(x)} |" for x in budgets)
    return f"""# {name}

An anytime-reasoning model trained with anytime (BRPO): it answers at any thinking budget. A trace cut
at budget B is closed with {answer_format.close_text!r}, the answer follows the header {answer_format.header!r}
and is at most {answer_format.summary_max_tokens} tokens long. The eval appended {protocol.instruction!r} to
every problem. The protocol is in `anytime_protocol.json`; `generation_config.json` holds the eval's
sampling (temperature {protocol.temperature}, top-p {protocol.top_p}).

## Anytime eval of the run

{table or "No eval of the run was found beside the checkpoint (final_eval.json)."}

## Serve it at a budget

```bash
anytime serve {name}
```

`anytime serve` starts vLLM's OpenAI-compatible server with the reasoning settings the protocol needs
(`--print-command` shows the plain `vllm serve` command). A request sets `thinking_token_budget`. vLLM
counts it from `{protocol.think_start}`, so it includes the {protocol.start_tokens_in_prompt} token(s) the
chat template puts after that marker and the {protocol.close_phrase_tokens} tokens of the close text's
phrase. To think for B tokens as the eval counted them:

| budget B (eval) | thinking_token_budget |
|---:|---:|
{rows}

`skip_special_tokens: false` keeps the end marker in the text, where vLLM's reasoning parser looks for it
to split the thinking (`reasoning`) from the answer (`content`).

```bash
curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(request)}
```
"""


def write_serving_files(folder: Path, ckpt: Path, tokenizer: Any, name: str | None = None) -> AnswerProtocol:
    """The protocol file, the eval's sampling in generation_config.json and the model card."""
    from transformers import GenerationConfig

    protocol, run = protocol_for(ckpt, tokenizer)
    protocol.write(folder)
    generation = GenerationConfig.from_pretrained(folder)
    generation.update(do_sample=protocol.temperature > 0, temperature=protocol.temperature, top_p=protocol.top_p)
    generation.save_pretrained(folder)
    (folder / "README.md").write_text(model_card(name or str(folder), protocol, run))
    return protocol
