"""RL step-timeline simulator: the steady-state step time of lock-step, locked-staleness and in-flight
training, from decode and learner throughputs and a sample of trace lengths (docs/async.md).

A discrete-event timeline over `steps` batches. Each rollout device runs one continuous-batching
engine: a decode step of n active sequences takes `latency_s + n / peak_tokens_per_s` and advances
each by a token; at most `max_seqs` are active, the rest wait. A trace's cuts × summaries_per_cut
summaries are queued the moment it ends (the streamed schedule of anytime.rollout.engines.vllm); free slots
go to the oldest batch first, its summaries before its unstarted traces. A batch is learned when
every device has finished it: its trained tokens (prompt + thinking + summaries per trace) over
learner devices × learner_tokens_per_s, then `weight_sync_s` of the learner's time to send the new
version. `lockstep` and `locked` engines run one batch at a time and take a version between two
batches (the transfer overlaps generation); `inflight` engines start traces of any batch the
staleness bound allows and pause for `weight_sync_s` at every version swap, mid-generation.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np

MODES = ("lockstep", "locked", "inflight")
_DONE = 1e-6   # tokens left below which a sequence counts as finished (float error of the lazy advances)


@dataclass(frozen=True)
class DecodeModel:
    """Time of one decode step of an engine: `latency_s + active / peak_tokens_per_s`."""

    latency_s: float
    peak_tokens_per_s: float

    def step_s(self, active: int) -> float:
        return self.latency_s + active / self.peak_tokens_per_s


@dataclass(frozen=True)
class Hardware:
    decode: DecodeModel          # per rollout device
    max_seqs: int                # sequences one engine decodes at once (vLLM max_num_seqs, or what the KV cache holds)
    learner_tokens_per_s: float  # per learner device, the whole update (old log-probs + forward/backward)
    weight_sync_s: float         # learner time to send one version; an in-flight engine pauses as long


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    traces_per_prompt: int
    budgets: tuple[int, ...]     # thinking budgets, increasing; traces stop at the last
    summaries_per_cut: int
    summary_tokens: int          # decoded and trained tokens of one summary
    prompt_tokens: int
    trace_lengths: tuple[int, ...]   # a sample of natural thinking lengths (drawn with replacement, capped)

    @property
    def summaries_per_trace(self) -> int:
        return len(self.budgets) * self.summaries_per_cut


@dataclass(frozen=True)
class Split:
    """Devices for each side; `colocated`: the same devices generate, then learn (lockstep only)."""

    rollout: int
    learner: int
    colocated: bool = False

    @classmethod
    def colocated_on(cls, devices: int) -> Split:
        return cls(devices, devices, colocated=True)

    def label(self) -> str:
        return f"{self.rollout} colocated" if self.colocated else f"{self.rollout}:{self.learner}"


@dataclass(frozen=True)
class Prediction:
    """Steady-state means per step (seconds). Rollout columns are per rollout device (generation
    and summaries split by the share of active sequences); a colocated split's devices do both, so
    both idle columns are the same time. generation + summaries + engine_pause + rollout_idle
    (+ learner + sync when colocated) = step_s; learner + sync + learner_idle (+ the rollout
    columns when colocated) = step_s."""

    mode: str
    staleness: int
    split: str
    step_s: float
    first_step_s: float          # startup: the first batch from t = 0 to its synced weights
    generation_s: float
    summaries_s: float
    engine_pause_s: float
    rollout_idle_s: float
    learner_s: float
    sync_s: float
    learner_idle_s: float
    step_times: tuple[float, ...]

    def as_dict(self) -> dict:
        return asdict(self)


def calibrate(point_a: tuple[int, float], point_b: tuple[int, float]) -> DecodeModel:
    """The decode model through two measured (active sequences, seconds per decode step) points."""
    (n_a, s_a), (n_b, s_b) = sorted([point_a, point_b])
    if n_a == n_b or min(n_a, s_a, s_b) <= 0:
        raise ValueError(f"calibrate needs two positive step times at two different batch sizes, got {point_a} "
                         f"and {point_b}: measure again at batches further apart")
    per_sequence = (s_b - s_a) / (n_b - n_a)
    latency = s_a - n_a * per_sequence
    if per_sequence <= 0 or latency < 0:
        raise ValueError(f"{point_a} and {point_b} give {per_sequence:.3g} s per sequence and {latency:.3g} s latency; "
                         "the first must be > 0 and the second >= 0 (a larger batch takes longer, by less than in proportion): "
                         "measure again, with more steps per point or batches further apart")
    return DecodeModel(latency, 1.0 / per_sequence)


class _Engine:
    """One rollout device's engine, advanced lazily to each event that touches it."""

    def __init__(self, traces: list[np.ndarray], workload: Workload, hardware: Hardware):
        self.traces, self.started = traces, [0] * len(traces)   # per batch: trace lengths, how many started
        self.per_trace, self.summary_tokens = workload.summaries_per_trace, workload.summary_tokens
        self.decode, self.slots = hardware.decode, hardware.max_seqs
        self.waiting = np.zeros(len(traces), dtype=int)          # summaries queued, per batch
        self.left = np.array([t.size * (1 + self.per_trace) for t in traces])  # unfinished sequences
        self.rem, self.batch, self.is_trace = np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=bool)
        self.clock, self.paused, self.token, self.oldest = 0.0, False, 0, 0
        self.busy = {"generation_s": 0.0, "summaries_s": 0.0, "engine_pause_s": 0.0}

    def advance(self, now: float) -> None:
        dt, self.clock = now - self.clock, now
        if self.paused and self.rem.size:   # sequences held mid-generation; a pause with none is idle time
            self.busy["engine_pause_s"] += dt
        elif self.rem.size:
            self.rem -= dt / self.decode.step_s(self.rem.size)
            thinking = self.is_trace.mean()
            self.busy["generation_s"] += dt * thinking
            self.busy["summaries_s"] += dt * (1.0 - thinking)

    def finish(self) -> list[int]:
        """Drop the finished sequences, queue their summaries; the batches this completes."""
        done = self.rem <= _DONE
        if not done.any():
            return []
        np.add.at(self.waiting, self.batch[done & self.is_trace], self.per_trace)
        counts = np.bincount(self.batch[done], minlength=self.left.size)
        self.left -= counts
        self.rem, self.batch, self.is_trace = self.rem[~done], self.batch[~done], self.is_trace[~done]
        return [int(b) for b in np.flatnonzero((counts > 0) & (self.left == 0))]

    def admit(self, newest: int, one_batch_at_a_time: bool) -> None:
        """Fill free slots: oldest batch first, its summaries before its traces; traces only of batches
        up to `newest` (the staleness bound), and only of the oldest unfinished one when `one_batch_at_a_time`."""
        while self.oldest < self.left.size and self.left[self.oldest] == 0:
            self.oldest += 1
        free, new = self.slots - self.rem.size, []
        last = min(newest, self.left.size - 1, self.oldest if one_batch_at_a_time else self.left.size)
        for b in range(self.oldest, last + 1):
            if free == 0:
                break
            if take := min(free, int(self.waiting[b])):
                new.append((np.full(take, float(self.summary_tokens)), b, False))
                self.waiting[b] -= take
                free -= take
            if (lengths := self.traces[b][self.started[b]:self.started[b] + free]).size:
                new.append((lengths.astype(float), b, True))
                self.started[b] += lengths.size
                free -= lengths.size
        if new:
            self.rem = np.concatenate([self.rem, *(r for r, _, _ in new)])
            self.batch = np.concatenate([self.batch, *(np.full(r.size, b) for r, b, _ in new)])
            self.is_trace = np.concatenate([self.is_trace, *(np.full(r.size, t) for r, _, t in new)])

    def next_event(self) -> float:
        if self.paused or not self.rem.size:
            return math.inf
        return self.clock + self.rem.min() * self.decode.step_s(self.rem.size)


def _validate(mode: str, workload: Workload, hardware: Hardware, split: Split, staleness: int, warmup: int,
              steps: int) -> None:
    w, h = workload, hardware
    problems = [
        (mode not in MODES, f"unknown mode {mode!r}: use one of {MODES}"),
        (split.rollout < 1 or split.learner < 1, f"split {split}: give each side at least one device"),
        (split.colocated and split.rollout != split.learner,
         f"a colocated split uses the same devices for both sides: Split.colocated_on({split.rollout})"),
        (split.colocated and mode != "lockstep",
         f"{mode} overlaps generation with learning, which a colocated split cannot: use separate devices"),
        (staleness < 0, f"staleness {staleness} < 0: give k >= 0 (0 = on-policy)"),
        (mode == "lockstep" and staleness != 0, "lockstep is staleness 0: use mode 'locked' for k > 0"),
        (h.decode.latency_s < 0 or h.decode.peak_tokens_per_s <= 0,
         f"decode model {h.decode}: latency must be >= 0 and peak tokens/s > 0"),
        (h.learner_tokens_per_s <= 0, f"learner_tokens_per_s {h.learner_tokens_per_s}: give a throughput > 0"),
        (h.weight_sync_s < 0, f"weight_sync_s {h.weight_sync_s}: give a time >= 0"),
        (h.max_seqs < 1, f"max_seqs {h.max_seqs}: an engine needs at least one slot"),
        (min(w.prompts_per_step, w.traces_per_prompt, w.summaries_per_cut, w.summary_tokens) < 1 or w.prompt_tokens < 0,
         "prompts, traces, summaries per cut and summary tokens must be >= 1 (prompt tokens >= 0)"),
        (not w.budgets or any(b <= a for a, b in zip((0, *w.budgets), w.budgets)),
         f"budgets {w.budgets}: give positive, increasing thinking budgets"),
        (not w.trace_lengths or min(w.trace_lengths) < 1,
         f"trace_lengths ({len(w.trace_lengths)} values): give a non-empty sample of thinking lengths, each >= 1"),
        (steps < warmup + 2, f"{steps} steps leave under 2 after the {warmup}-step warm-up: raise steps"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(message)


def simulate(mode: str, workload: Workload, hardware: Hardware, split: Split, staleness: int = 0,
             steps: int = 24, seed: int = 0) -> Prediction:
    """Run `steps` batches on the event timeline; the first max(k + 2, steps // 4) are the warm-up.
    Batch t is generated from weights version >= t - staleness (`lockstep`: exactly t)."""
    warmup = max(staleness + 2, steps // 4)
    _validate(mode, workload, hardware, split, staleness, warmup, steps)
    w, h = workload, hardware
    batches = steps + staleness + 1   # the engines' work past the last learned step keeps them as busy as before
    draw = np.random.default_rng(seed).choice(np.asarray(w.trace_lengths), (batches, w.prompts_per_step,
                                                                            w.traces_per_prompt))
    lengths = np.minimum(draw, w.budgets[-1])   # a trace stops at the largest budget
    owner = np.arange(w.prompts_per_step) % split.rollout       # whole prompts per device, dealt in turn
    engines = [_Engine([lengths[t, owner == d].ravel() for t in range(batches)], w, h) for d in range(split.rollout)]
    trained = lengths.sum(axis=(1, 2)) + w.prompts_per_step * w.traces_per_prompt * (
        w.prompt_tokens + w.summaries_per_trace * w.summary_tokens)
    learn_s = trained / (split.learner * h.learner_tokens_per_s)
    sync_s, inflight = h.weight_sync_s, mode == "inflight"
    ready = np.array([sum(e.left[t] == 0 for e in engines) for t in range(batches)])   # devices done per batch
    heap: list[tuple[float, int, str, int, int]] = []
    order, version, next_learn, learning = itertools.count(), 0, 0, False
    done_at: list[float] = []
    snapshots: list[dict[str, float]] = []

    def push(at: float, kind: str, a: int = 0, b: int = 0) -> None:
        heapq.heappush(heap, (at, next(order), kind, a, b))   # ties: first pushed, first served

    def admit_and_schedule(i: int) -> None:
        engine = engines[i]
        engine.admit(version + staleness, one_batch_at_a_time=not inflight)
        engine.token += 1   # an engine's earlier event is stale once its sequences change
        if math.isfinite(at := engine.next_event()):
            push(at, "engine", i, engine.token)

    def maybe_learn(now: float) -> None:
        nonlocal learning
        if not learning and next_learn < steps and ready[next_learn] == len(engines):
            learning = True
            push(now + learn_s[next_learn], "learned", next_learn)

    for i in range(len(engines)):
        admit_and_schedule(i)
    maybe_learn(0.0)
    while len(done_at) < steps:
        now, _, kind, a, b = heapq.heappop(heap)
        if kind == "engine":
            if b != engines[a].token:
                continue
            engines[a].advance(now)
            for batch in engines[a].finish():
                ready[batch] += 1
            admit_and_schedule(a)
        elif kind == "learned":
            if inflight:   # the engines take the new weights mid-generation: they stop while they arrive
                for engine in engines:
                    engine.advance(now)
                    engine.paused, engine.token = True, engine.token + 1
            push(now + sync_s, "synced", a)
        else:
            version, next_learn, learning = a + 1, a + 1, False
            for i, engine in enumerate(engines):
                engine.advance(now)
                engine.paused = False
                admit_and_schedule(i)
            done_at.append(now)
            totals = {k: sum(e.busy[k] for e in engines) / len(engines) for k in engines[0].busy}
            snapshots.append({**totals, "learner_s": float(learn_s[:a + 1].sum()), "sync_s": sync_s * (a + 1)})
        maybe_learn(now)
    return _prediction(mode, staleness, split, done_at, snapshots, warmup)


def _prediction(mode: str, staleness: int, split: Split, done_at: list[float], snapshots: list[dict[str, float]],
                warmup: int) -> Prediction:
    """Means over the steady window: from the end of step `warmup` - 1 to the end of the last."""
    count = len(done_at) - warmup
    step_s = float(done_at[-1] - done_at[warmup - 1]) / count
    part = {k: float(snapshots[-1][k] - snapshots[warmup - 1][k]) / count for k in snapshots[-1]}
    rollout_busy = part["generation_s"] + part["summaries_s"] + part["engine_pause_s"]
    learner_busy = part["learner_s"] + part["sync_s"]
    both = rollout_busy + learner_busy
    return Prediction(
        mode=mode, staleness=staleness, split=split.label(), step_s=step_s, first_step_s=float(done_at[0]), **part,
        rollout_idle_s=step_s - (both if split.colocated else rollout_busy),
        learner_idle_s=step_s - (both if split.colocated else learner_busy),
        step_times=tuple(float(x) for x in np.diff([0.0, *done_at])))
