"""A vLLM logits processor for `rollout.py`'s natural workload, in a module of its own so that an engine
core in another process (vLLM's AsyncLLM) can import it by name: its settings travel in vLLM's
`additional_config`, the one place a logits processor can read its own parameters from."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

KEY = "anytime_natural_lengths"


def natural_lengths_config(think_end: int, banned: tuple[int, ...], cap: int, median: float,
                           sigma: float) -> dict[str, Any]:
    """The engine's `additional_config` for `NaturalLengths`."""
    return {KEY: {"think_end": think_end, "banned": list(banned), "cap": cap, "median": median, "sigma": sigma}}


class NaturalLengths(LogitsProcessor):
    """Ends each thinking request (one whose stop ids include `think_end`) after a log-normal number of
    tokens (median `median`, log-sd `sigma`): the ids in `banned` are masked before that length and
    `think_end` is forced at it (a draw past `cap`, the largest budget, runs to the cap). The length is a
    function of the request's seed, so a seeded trace has the same length whatever it is batched with.
    Summaries pass through untouched."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        c = vllm_config.additional_config[KEY]
        self.think_end, self.cap, self.median, self.sigma = c["think_end"], c["cap"], c["median"], c["sigma"]
        self.banned = torch.tensor(c["banned"], dtype=torch.long)
        self.rows: dict[int, tuple[int, list[int]]] = {}  # batch row -> (length, its live output ids)

    def length_of(self, seed: int) -> int:
        draw = np.random.default_rng(seed).lognormal(math.log(self.median), self.sigma)
        return max(1, min(self.cap + 1, math.ceil(draw)))

    def is_argmax_invariant(self) -> bool:
        return False

    def _state(self, params: Any, _prompt: Any, output: list[int]) -> tuple[int, list[int]] | None:
        if params.seed is None or self.think_end not in (params.stop_token_ids or ()):
            return None
        return self.length_of(params.seed), output

    def update_state(self, batch_update: Any) -> None:
        process_dict_updates(self.rows, batch_update, self._state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        ban, force = [], []
        for row, (length, output) in self.rows.items():
            (force if len(output) + 1 >= length else ban).append(row)
        if ban:
            logits[torch.tensor(ban)[:, None], self.banned] = float("-inf")
        if force:
            logits[force] = float("-inf")
            logits[force, self.think_end] = 0.0
        return logits
