"""The step's metric sums, typed: what a rollout worker counts in its share of a step (scores per budget,
thinking lengths, verifier reasons, tokens, each token's weight version, dynamic sampling) and what the
trainer adds (advantages, rows). Sums add up exactly over draws, workers and ranks (`+`); the fields in
`MAX_FIELDS` keep the largest value instead. `metrics()` names the step's metrics from them, so a metric
and the sums it comes from are declared in one place (a missing sum is an attribute error at the line
that adds it, not a KeyError at the end of a step).

They travel as plain dicts (`to_dict` / `from_dict`: to a worker process, Ray's object store, a checkpoint
of the rollouts in flight), in the flat `name: value` form earlier versions wrote, so an in-flight
checkpoint of an older run still loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

MAX_FIELDS = frozenset({"token_lag_max"})


@dataclass
class StepSums:
    """Sums of one step's (or one worker's share of it) metrics; see the module docstring."""

    # the rollout (`anytime.batch.anytime_rollout.rollout_sums`)
    traces: float = 0.0                  # thinking traces sampled
    summaries_per_budget: float = 0.0    # summaries at each budget (traces × A)
    acc: list[float] = field(default_factory=list)   # per budget: the sum of the summaries' scores
    think_len: float = 0.0               # thinking tokens over all traces
    closed: float = 0.0                  # traces that closed their thinking by themselves
    tokens: float = 0.0                  # sampled tokens, thinking and summaries
    reasons: dict[str, float] = field(default_factory=dict)   # verifier outcomes by reason
    # each sampled token's weight version (`anytime.rollout.workers.inflight.version_sums`): lag = step - version
    token_lag: float = 0.0
    token_lag_n: float = 0.0
    token_lag_max: float = 0.0
    mixed_version_traces: float = 0.0    # traces whose tokens span two versions (in flight)
    weight_swaps: float = 0.0            # in-flight swaps during the rollout
    # dynamic sampling (`anytime.rollout.workers.dynamic_sampling.Draws.counts`); slots 0 = off
    dynamic_slots: float = 0.0
    dynamic_drawn: float = 0.0
    dynamic_kept: float = 0.0
    rollout_seconds: float = 0.0         # the worker's wall time for its share
    # the trainer's (`anytime.trainer.experience`)
    thinking_adv: float = 0.0            # thinking advantages, over every segment of every group drawn
    thinking_adv_abs: float = 0.0
    thinking_adv_n: float = 0.0
    summary_adv_abs: float = 0.0
    summary_adv_n: float = 0.0
    rows: float = 0.0                    # sequences trained (a thinking trace or a summary)

    def __add__(self, other: StepSums) -> StepSums:
        out = StepSums()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "acc":
                value = [x + y for x, y in zip(a, b)] if a and b else list(a or b)
            elif f.name == "reasons":
                value = {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}
            elif f.name in MAX_FIELDS:
                value = max(a, b)
            else:
                value = a + b
            setattr(out, f.name, value)
        return out

    @staticmethod
    def total(parts: Sequence[StepSums]) -> StepSums:
        out = StepSums()
        for part in parts:
            out = out + part
        return out

    def accuracies(self) -> list[float]:
        """The training accuracy at each budget."""
        return [a / self.summaries_per_budget for a in self.acc]

    def metrics(self, budgets: Sequence[int]) -> dict[str, float]:
        """The step's rollout metrics (`train/`, `adv/`, `verifier/`, `rollout/`) from the added-up sums
        (the anytime score, a weighting by the recipe's prior, is the caller's)."""
        out = {f"train/acc@{b}": a for b, a in zip(budgets, self.accuracies())}
        out["train/think_len"] = self.think_len / self.traces
        out["train/think_closed_frac"] = self.closed / self.traces
        out["adv/thinking_mean"] = self.thinking_adv / self.thinking_adv_n
        out["adv/thinking_abs"] = self.thinking_adv_abs / self.thinking_adv_n
        out["adv/summary_abs"] = self.summary_adv_abs / self.summary_adv_n
        counted = {k: v for k, v in self.reasons.items() if v}
        out.update({f"verifier/{k}": v / sum(counted.values()) for k, v in counted.items()})
        out["train/rows"] = int(self.rows)
        if self.dynamic_slots:
            out.update(self.dynamic_metrics())
        if self.token_lag_n:   # every token's staleness, from the versions the engines recorded
            out["rollout/token_version_lag"] = self.token_lag / self.token_lag_n
            out["rollout/token_version_lag_max"] = self.token_lag_max
            out["rollout/mixed_version_traces"] = self.mixed_version_traces / self.traces
            out["rollout/weight_swaps"] = self.weight_swaps
        return out

    def dynamic_metrics(self) -> dict[str, float]:
        """Dynamic sampling's: groups dropped for one reward, prompts drawn per one kept, slots that train nothing."""
        return {
            "rollout/dynamic_dropped_frac": (self.dynamic_drawn - self.dynamic_kept) / max(self.dynamic_drawn, 1.0),
            "rollout/dynamic_drawn_per_kept": self.dynamic_drawn / max(self.dynamic_kept, 1.0),
            "rollout/dynamic_unfilled_frac": (self.dynamic_slots - self.dynamic_kept) / max(self.dynamic_slots, 1.0),
        }

    # ---- the wire form: the flat names earlier versions sent and saved ----------------------------
    def to_dict(self) -> dict[str, float]:
        out = {f"acc_sum/{j}": a for j, a in enumerate(self.acc)}
        out.update({f"reason/{k}": v for k, v in self.reasons.items()})
        out.update({_WIRE.get(f.name, f.name): getattr(self, f.name) for f in fields(self)
                    if f.name not in ("acc", "reasons")})
        return out

    @classmethod
    def from_dict(cls, flat: Mapping[str, float]) -> StepSums:
        named = {_FIELD.get(k, k): float(v) for k, v in flat.items() if "/" not in k or k in _FIELD}
        acc = [float(flat[f"acc_sum/{j}"]) for j in range(sum(k.startswith("acc_sum/") for k in flat))]
        reasons = {k.split("/", 1)[1]: float(v) for k, v in flat.items() if k.startswith("reason/")}
        known = {f.name for f in fields(cls)}
        return cls(acc=acc, reasons=reasons, **{k: v for k, v in named.items() if k in known})


# field -> the flat name earlier versions used
_WIRE = {"think_len": "think_len_sum", "closed": "closed_sum", "token_lag": "token_lag_sum",
         "token_lag_max": "max/token_lag", "dynamic_slots": "dynamic/slots", "dynamic_drawn": "dynamic/drawn",
         "dynamic_kept": "dynamic/kept", "thinking_adv": "t_adv_sum", "thinking_adv_abs": "t_adv_abs_sum",
         "thinking_adv_n": "t_adv_n", "summary_adv_abs": "s_adv_abs_sum", "summary_adv_n": "s_adv_n"}
_FIELD = {wire: name for name, wire in _WIRE.items()}
