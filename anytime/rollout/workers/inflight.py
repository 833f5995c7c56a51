"""In-flight weight updates (`rollout.staleness_mode: inflight`): a rollout worker takes each new
weight version as it arrives, between two decoding steps of its engine, instead of between two
rollouts. Unfinished traces continue under the new weights (partial rollouts, over the keys and
values cached under the old ones, as PipelineRL does), a trace's summaries are sampled with whatever
version is current when they start, and every token records the version that computed its
distribution (`Completion.versions`), so the learner's importance weights use the right behaviour
log-probs and the metrics report each token's staleness.

The learner offers a version to the worker's `WeightMailbox` from another thread (a Ray concurrency
group of the actor) while the engine generates; the engine polls the mailbox and pauses only for the
copy. A rollout for step t waits until version t - k is in hand, so no token is older than k steps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from anytime.batch.step_sums import StepSums

if TYPE_CHECKING:
    from anytime.batch.anytime_rollout import AnytimeRollout

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightMailbox:
    """The newest weight version offered to one worker, until its engine takes it. Older offers not
    yet taken are dropped: the engine always jumps to the newest."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._offer: tuple[int, NamedTensors] | None = None
        self._taken = 0   # the newest version the engine took (or started with)

    def offer(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._ready:
            if version > self._taken and (self._offer is None or version > self._offer[0]):
                self._offer = (version, list(named_tensors))
                self._ready.notify_all()

    def take(self, held: int) -> tuple[int, NamedTensors] | None:
        """A version newer than `held`, if one was offered (the engine's `weight_source`)."""
        with self._ready:
            offer, self._offer = self._offer, None
            if offer is None or offer[0] <= held:
                return None
            self._taken = offer[0]
            return offer

    def wait_for(self, version: int, held: int, timeout_s: float) -> None:
        """Block until the engine holds `version` or a newer one is waiting to be taken."""
        with self._ready:
            if not self._ready.wait_for(lambda: held >= version or self._taken >= version
                                        or (self._offer is not None and self._offer[0] >= version), timeout_s):
                raise TimeoutError(f"weight version {version} did not reach the rollout worker within "
                                   f"{timeout_s:.0f} s (it holds version {max(held, self._taken)})")


def version_sums(rollout: AnytimeRollout, step: int) -> StepSums:
    """Staleness sums of a rollout trained at `step` (lag = step - the token's version), over every
    sampled thinking and summary token; they add up across workers (the maximum stays one)."""
    if rollout.think_versions is None or rollout.summary_versions is None:
        return StepSums()
    think_valid = torch.arange(rollout.think_versions.shape[-1]) < rollout.think_len[..., None]
    summary_valid = torch.arange(rollout.summary_versions.shape[-1]) < rollout.summary_len[..., None]
    lags = torch.cat([(step - rollout.think_versions)[think_valid], (step - rollout.summary_versions)[summary_valid]])
    versions = rollout.think_versions.masked_fill(~think_valid, -1)
    spans = versions.amax(-1) > versions.masked_fill(~think_valid, 1 << 62).amin(-1)
    return StepSums(token_lag=float(lags.sum()), token_lag_n=float(lags.numel()),
                    token_lag_max=float(lags.max()) if lags.numel() else 0.0,
                    mixed_version_traces=float((spans & (rollout.think_len > 0)).sum()))
