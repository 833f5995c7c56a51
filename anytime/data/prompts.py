"""Prompt sets: hub datasets, local json/jsonl/parquet files, or the synthetic task; answer
checks; prompt rendering with the tokenizer's chat template."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anytime import defaults
from anytime.tasks import synthetic

log = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
SYNTHETIC_TRAIN_SEED, SYNTHETIC_EVAL_SEED = 1_000, 9_999_999


class DataError(ValueError):
    """A dataset that cannot be used as given; the message names the file/key to fix."""


@dataclass(frozen=True)
class PromptRow:
    id: str
    problem: str
    answer: Any          # raw gold (str, float or list); the verifier normalises it


def _read_local(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import datasets

        return list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict):  # {"data": [...]} or {"train": [...]}
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON array of rows (or an object holding one array)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of rows")
    return data


def _read_hub(name: str, split: str) -> list[dict[str, Any]]:
    """`name` may carry a config after a colon: `Hothan/OlympiadBench:OE_TO_maths_en_COMP`."""
    import datasets

    repo, _, config = name.partition(":")
    try:
        return list(datasets.load_dataset(repo, config or None, split=split))
    except Exception as exc:  # offline, unknown name, bad split: say which and how to fix
        raise DataError(f"could not load dataset {name!r} (split {split!r}) from the Hugging Face hub: "
                        f"{type(exc).__name__}: {exc}. Give a local .json/.jsonl/.parquet path instead, "
                        "or check the name and your network / HF_HUB_OFFLINE setting.") from None


def is_local_source(source: str) -> bool:
    return source.endswith(LOCAL_SUFFIXES) or source.startswith((".", "/", "~"))


def synthetic_rows(size: int, seed: int, min_ops: int, max_ops: int, exclude: Sequence[PromptRow] = ()) -> list[PromptRow]:
    taken = {row.problem for row in exclude}
    problems = synthetic.make_problems(size + len(taken), seed, min_ops, max_ops)
    rows = [PromptRow(f"synthetic-{seed}-{i}", p.problem, str(p.answer)) for i, p in enumerate(problems)
            if p.problem not in taken]
    return rows[:size]


def load_rows(source: str, *, split: str = "train", problem_key: str = "problem", answer_key: str = "answer",
              limit: int | None = None, shuffle_seed: int | None = None) -> list[PromptRow]:
    """Rows from a local file or a hub dataset. Rows missing a problem or an answer are dropped and
    reported (count and first ids); a source where no row is usable is an error."""
    if is_local_source(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise DataError(f"dataset file {str(path)!r} does not exist")
        raw, origin = _read_local(path), str(path)
    else:
        raw, origin = _read_hub(source, split), source
    rows, bad = [], []
    for i, item in enumerate(raw):
        rid = str(item.get("id", item.get("unique_id", i))) if isinstance(item, dict) else str(i)
        problem = item.get(problem_key) if isinstance(item, dict) else None
        answer = item.get(answer_key) if isinstance(item, dict) else None
        if not isinstance(problem, str) or not problem.strip() or answer is None or answer == "" or answer == []:
            bad.append(rid)
            continue
        rows.append(PromptRow(rid, problem, answer))
    if bad:
        log.warning("%s: skipped %d row(s) without a %r or %r field (first ids: %s)", origin, len(bad),
                    problem_key, answer_key, ", ".join(bad[:5]))
    if not rows:
        keys = sorted(raw[0].keys()) if raw and isinstance(raw[0], dict) else []
        raise DataError(f"{origin}: no row has both {problem_key!r} and {answer_key!r}; the rows have keys {keys}. "
                        "Set data.problem_key / data.answer_key to the right field names.")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(rows)
    return rows[:limit] if limit is not None else rows


def user_message(problem: str, instruction: str = defaults.INSTRUCTION) -> str:
    return f"{problem} {instruction}".strip()


def render_prompt(tokenizer: Any, problem: str, instruction: str = defaults.INSTRUCTION) -> list[int]:
    """Token ids of the chat-templated prompt with the generation prompt appended."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message(problem, instruction)}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(user_message(problem, instruction), add_special_tokens=True)["input_ids"])


def encode_prompts(tokenizer: Any, rows: Sequence[PromptRow], instruction: str, max_prompt_len: int,
                   limit_name: str = "data.max_prompt_len") -> list[list[int]]:
    """Render every row; a prompt longer than `max_prompt_len` is an error naming the row and the limit."""
    out = []
    for row in rows:
        ids = render_prompt(tokenizer, row.problem, instruction)
        if len(ids) > max_prompt_len:
            raise DataError(f"prompt of row {row.id!r} has {len(ids)} tokens, above {limit_name} = "
                            f"{max_prompt_len}; raise the limit or filter the dataset")
        out.append(ids)
    return out
