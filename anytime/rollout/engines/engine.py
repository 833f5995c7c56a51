"""The rollout-engine interface: what the anytime rollout asks of a generator.

Two requests cover the method: ``generate`` (thinking traces from prompts) and ``generate_branches``
(summaries that share a thinking trace: each branch keeps ``prefix[:cut]``, appends forced tokens,
and samples ``n`` completions). ``generate_anytime`` composes them for the anytime rollout: traces,
then the summaries a plan asks for on each trace. Its default runs two phases (all thinking, then
all summaries); an engine that can queue a trace's summaries the moment that trace ends, while
others still think (the official code's schedule), overrides it and samples the same tokens.
Engines differ only in how fast they serve these requests (transformers with a reused KV cache,
vLLM with prefix caching); every engine validates requests identically, before the generation they
belong to starts, so a bad request never yields partial results.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample. ``temperature == 0`` means greedy decoding.

    Generation stops AFTER emitting one of ``stop_token_ids`` (the stop token is kept in the output)
    or after ``max_new_tokens``. Nothing else stops it: an EOS id stops generation only if it is
    listed in ``stop_token_ids``, so both engines stop on exactly the same tokens.
    """

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # One seed per request of the call (a prompt, or a branch in prefix-major order), derived by the
    # caller from each request's global index: samples then do not depend on which worker or batch
    # served a request. Overrides `seed`.
    request_seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        # Accept any sequence (e.g. a list from a YAML recipe) but store a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.request_seeds is not None:
            object.__setattr__(self, "request_seeds", tuple(int(t) for t in self.request_seeds))

    def seeds_for(self, num_requests: int) -> list[int] | None:
        """The seed of each of `num_requests` requests (None: unseeded sampling)."""
        from anytime.rollout.seeding import request_seeds

        if self.request_seeds is not None:
            if len(self.request_seeds) != num_requests:
                raise ValueError(f"{len(self.request_seeds)} request seeds for {num_requests} requests")
            return list(self.request_seeds)
        return None if self.seed is None else request_seeds(self.seed, range(num_requests))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]``: by default under the RAW model
    distribution (log_softmax of the logits before temperature / top-p; vLLM's ``raw_logprobs``), or,
    from an engine built with ``logprobs="processed"``, under the distribution it was sampled from
    (after temperature and top-p; vLLM's ``processed_logprobs``). Greedy samples always carry raw ones.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # the weight version that computed each token's distribution; empty where the engine does not
    # take weights mid-generation (every token then has the version the engine held)
    versions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Branch:
    """A summary request on a shared prefix: the branch prompt is ``prefix[:cut] + suffix``."""

    cut: int
    suffix: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "suffix", tuple(int(t) for t in self.suffix))


# A source of in-flight weights, polled by the engine between decoding steps: called with the version
# the engine holds, it returns a newer (version, Hugging Face named tensors), or None.
WeightSource = Callable[[int], tuple[int, list[tuple[str, torch.Tensor]]] | None]

# plan(k, trace) -> the branches of trace k (k = prompt index · n + sample index) on the prefix
# prompt + trace.token_ids; see `RolloutEngine.generate_anytime`.
PlanFn = Callable[[int, Completion], Sequence[Branch]]


@dataclass
class AnytimeGeneration:
    """What `RolloutEngine.generate_anytime` returns. When summaries stream, they overlap thinking:
    `thinking_s` then includes that overlap and `total_s - thinking_s` is only the summary time
    that did not overlap any thinking (all of the summary time when the engine runs two phases)."""

    traces: list[list[Completion]]              # [prompt][sample]
    summaries: list[list[list[Completion]]]     # [trace k][branch][summary sample]
    thinking_s: float                           # from the call to the end of its last trace
    total_s: float                              # from the call to the end of its last summary


class EngineError(RuntimeError):
    """The engine (or its worker) failed while serving a request; no partial results are returned."""


class RolloutEngine(abc.ABC):
    """Base class: validation and the context-manager protocol; subclasses implement ``_generate*``.

    ``max_model_len`` bounds prompt + generated tokens of every request. ``max_prompt_len`` (optional)
    bounds the prompts passed to ``generate``; branch prompts contain a thinking trace and are
    bounded by ``max_model_len`` only.
    """

    max_model_len: int
    max_prompt_len: int | None
    vocab_size: int
    _weight_shapes: dict[str, tuple[int, ...]]  # Hugging Face state-dict names and shapes

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt; result is indexed ``[prompt][sample]``."""
        self._check_open()
        self._check_prompts(prompts, params)
        if not prompts:
            return []
        return self._generate([list(p) for p in prompts], params)

    def generate_branches(
        self,
        prefixes: Sequence[Sequence[int]],
        branches: Sequence[Sequence[Branch]],
        params: SamplingConfig,
    ) -> list[list[list[Completion]]]:
        """Sample ``params.n`` completions per branch; result is indexed ``[prefix][branch][sample]``."""
        self._check_open()
        if len(prefixes) != len(branches):
            raise ValueError(
                f"got {len(prefixes)} prefixes but {len(branches)} branch lists: pass one list of branches per prefix"
            )
        for i, (prefix, brs) in enumerate(zip(prefixes, branches)):
            self._check_ids(f"prefixes[{i}]", prefix)
            self._check_branches(i, prefix, brs, params)
        if not any(branches):
            return [[] for _ in prefixes]
        return self._generate_branches([list(p) for p in prefixes], [list(b) for b in branches], params)

    def generate_anytime(
        self,
        prompts: Sequence[Sequence[int]],
        thinking: SamplingConfig,
        plan: PlanFn,
        summary: SamplingConfig,
    ) -> AnytimeGeneration:
        """``thinking.n`` traces per prompt, then ``summary.n`` samples of every branch that
        ``plan(k, trace)`` returns for trace k (k = prompt index · thinking.n + sample index), on the
        prefix ``prompts[k // thinking.n] + trace.token_ids``.

        ``plan`` is called once per trace, in any order, and must give every trace the same number
        of branches: branch j of trace k is request ``k · branches + j`` of ``summary`` (its seed in
        ``summary.request_seeds``), exactly as if all branches went to one ``generate_branches``
        call. This default runs the two phases one after the other; an engine that streams must
        sample the same tokens for the same seeds."""
        start = time.perf_counter()
        traces = self.generate(prompts, thinking)
        thinking_s = time.perf_counter() - start
        prefixes, branches = [], []
        for k, trace in enumerate(t for per_prompt in traces for t in per_prompt):
            prefixes.append(list(prompts[k // thinking.n]) + trace.token_ids)
            branches.append(planned(plan, k, trace, len(branches[0]) if branches else None))
        summaries = self.generate_branches(prefixes, branches, summary)
        return AnytimeGeneration(traces, summaries, thinking_s, time.perf_counter() - start)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy learner weights (Hugging Face parameter names) into the engine's model. Unknown names
        or wrong shapes raise ValueError before anything is copied (a bad update leaves the old
        weights intact)."""
        self._check_open()
        self._load_weights(self._checked_updates(named_tensors))

    def took_version(self, version: int) -> None:
        """The weights just loaded (between rollouts) are weight version `version`: every token sampled
        from now on records it, so each token's staleness comes from the data in every mode."""
        self.version = version

    # ---- in-flight weight updates (`rollout.staleness_mode: inflight`) ------------------------
    # An engine that can swap weights between decoding steps polls `weight_source` there (and
    # before each prefill): generation pauses only for the copy, unfinished sequences continue with
    # the new weights over the keys/values cached under the old ones (as PipelineRL does), and each
    # token records the version that computed its distribution (`Completion.versions`).
    supports_inflight_updates = False
    version = 0                      # the weight version the engine holds (every sync and swap sets it)
    swaps = 0                        # in-flight swaps so far, and the seconds generation paused for them
    swap_seconds = 0.0
    weight_source: WeightSource | None = None

    def poll_weights(self) -> None:
        """Take newer weights from `weight_source`, if it has any."""
        source = self.weight_source
        offer = source(self.version) if source is not None else None
        if offer is None:
            return
        version, named_tensors = offer
        start = time.perf_counter()
        self._swap_weights(self._checked_updates(named_tensors), version)
        self.version, self.swaps = version, self.swaps + 1
        self.swap_seconds += time.perf_counter() - start

    def _swap_weights(self, updates: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy checked weights (of weight `version`) in place mid-generation, keeping the caches of
        the sequences in flight."""
        raise NotImplementedError(f"{type(self).__name__} cannot take weights between decoding steps")

    def _checked_updates(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        updates = [(name, t.detach()) for name, t in named_tensors]
        shapes = self._weight_shapes
        unknown = [name for name, _ in updates if name not in shapes]
        if unknown:
            raise ValueError(
                f"update_weights got {len(unknown)} names the model does not have, e.g. {unknown[:3]}: "
                "pass Hugging Face parameter names (strip wrappers such as 'module.' or '_orig_mod.')"
            )
        wrong = [(n, tuple(t.shape), shapes[n]) for n, t in updates if tuple(t.shape) != shapes[n]]
        if wrong:
            raise ValueError(f"update_weights shape mismatch (name, given, expected): {wrong[:3]}")
        return updates

    # Whether `update_adapter` merges LoRA factors itself (adapter-sized weight sync); engines that
    # do not take full merged weights through `update_weights`.
    accepts_adapters = False

    def update_adapter(self, factors: Sequence[tuple[str, torch.Tensor, torch.Tensor, float]]) -> None:
        """Set each named weight to its base value + (B @ A) * scaling, from (name, A, B, scaling)."""
        raise NotImplementedError(f"{type(self).__name__} takes full weights (update_weights), not LoRA factors")

    def sleep(self) -> None:
        """Free accelerator memory while the learner updates (weights kept on the host); a no-op where
        the engine has nothing to free."""

    def wake_up(self) -> None:
        """Undo `sleep` before the next generation or weight update."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the model and any engine processes. Idempotent."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- for subclasses ---------------------------------------------------------------------
    @abc.abstractmethod
    def _generate(self, prompts: list[list[int]], params: SamplingConfig) -> list[list[Completion]]: ...

    @abc.abstractmethod
    def _load_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        """Copy checked (name, tensor) pairs into the model."""

    @abc.abstractmethod
    def _generate_branches(
        self, prefixes: list[list[int]], branches: list[list[Branch]], params: SamplingConfig
    ) -> list[list[list[Completion]]]: ...

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def _check_open(self) -> None:
        if self.closed:
            raise EngineError(f"{type(self).__name__} is closed: create a new engine to generate")

    def _check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingConfig) -> None:
        for i, prompt in enumerate(prompts):
            self._check_prompt(f"prompts[{i}]", prompt, params, check_prompt_len=True)

    def _check_branches(self, i: int, prefix: Sequence[int], branches: Sequence[Branch],
                        params: SamplingConfig) -> None:
        """Branch prompts of prefix i (its ids already checked) must fit the engine."""
        for j, br in enumerate(branches):
            if not 0 <= br.cut <= len(prefix):
                raise ValueError(
                    f"branches[{i}][{j}].cut={br.cut} is outside prefix {i} (length {len(prefix)}): "
                    f"use a cut in [0, {len(prefix)}]"
                )
            prompt = list(prefix[: br.cut]) + list(br.suffix)
            self._check_prompt(f"branches[{i}][{j}] (prefix[:cut] + suffix)", prompt, params, check_prompt_len=False)

    def _check_ids(self, what: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"{what} contains token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def _check_prompt(
        self, what: str, prompt: Sequence[int], params: SamplingConfig, *, check_prompt_len: bool
    ) -> None:
        if len(prompt) == 0:
            raise ValueError(f"{what} is empty: every prompt needs at least one token")
        self._check_ids(what, prompt)
        if check_prompt_len and self.max_prompt_len is not None and len(prompt) > self.max_prompt_len:
            raise ValueError(
                f"{what} has {len(prompt)} tokens > max_prompt_len={self.max_prompt_len}: "
                "shorten or filter the prompt, or raise max_prompt_len"
            )
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"{what} has {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} "
                f"> max_model_len={self.max_model_len}: lower max_new_tokens or raise max_model_len"
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {self.vocab_size})")


def planned(plan: PlanFn, k: int, trace: Completion, expected: int | None) -> list[Branch]:
    """`plan`'s branches for trace k, which must number `expected` (None: the first trace)."""
    branches = list(plan(k, trace))
    if expected is not None and len(branches) != expected:
        raise ValueError(f"the plan gave trace {k} {len(branches)} branches but an earlier trace {expected}: "
                         "generate_anytime needs the same number of branches for every trace (their seeds "
                         "are numbered trace · branches + branch)")
    return branches


LOGPROBS_MODES = ("raw", "processed")   # what `Completion.logprobs` holds (see there)


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs={mode!r}: use one of {LOGPROBS_MODES}")
    return mode


def check_lengths(max_model_len: int, max_prompt_len: int | None, model_max_positions: int | None) -> None:
    """Shared constructor checks: lengths the model can actually serve."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if max_prompt_len is not None and not 1 <= max_prompt_len < max_model_len:
        raise ValueError(
            f"max_prompt_len={max_prompt_len} must be in [1, max_model_len={max_model_len}) "
            "to leave room for generation"
        )
    if model_max_positions is not None and max_model_len > model_max_positions:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max_positions}: "
            "lower max_model_len"
        )


def create_engine(kind: str, model_path: str, *, max_model_len: int, max_prompt_len: int | None = None,
                  dtype: str = "float32", seed: int = 0, **engine_kwargs: Any) -> RolloutEngine:
    """Build the rollout engine registered as `kind` in `anytime.components.ENGINES` (`"hf"`:
    transformers, `"vllm"`). `engine_kwargs` go to the engine class (e.g. `device`/`prefix_reuse`
    for hf, `kv_cache_gb`/`gpu_memory_utilization` for vllm)."""
    from anytime.components import ENGINES

    return ENGINES.get(kind)(model_path, max_model_len=max_model_len, max_prompt_len=max_prompt_len, dtype=dtype,
                             seed=seed, **engine_kwargs)
