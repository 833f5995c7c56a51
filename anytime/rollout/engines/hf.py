"""Rollout engine on plain transformers (CPU or GPU): a batched sampling loop over a KV cache.

A hand-rolled loop over ``model(...)`` (rather than ``model.generate``) gives raw logprobs of each
sampled token and, above all, lets summaries reuse the thinking trace's KV cache:

- ``generate`` keeps each finished row's keys/values (prompt + thinking) until the next call, so
  ``generate_branches`` on ``prompt + trace`` prefixes starts from the very cache the thinking
  phase built; a prefix the engine has not just generated is prefilled once instead.
- each branch row copies its prefix's cache cut at ``cut``, continues RoPE positions from the cut
  via explicit ``position_ids``, feeds only the suffix tokens (batched for all branches of all
  prefixes, holes and padding hidden by the attention mask), and only then expands to ``n`` samples.

``prefix_reuse=False`` re-prefills every branch prompt instead; it exists so the benchmark can
measure what the reuse saves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from anytime.defaults import DTYPES, torch_dtype
from anytime.rollout.engines.engine import (Branch, Completion, RolloutEngine, SamplingConfig, check_lengths,
                                    check_logprobs_mode)
from anytime.rollout.seeding import sample_seeds, uniforms

logger = logging.getLogger(__name__)


# Keys/values of one sequence: per layer, ([kv_heads, length, head_dim], [kv_heads, length, head_dim]).
RowKV = list[tuple[torch.Tensor, torch.Tensor]]


class _PreallocatedLayer(DynamicLayer):
    """A cache layer whose appends write into a buffer allocated once for the whole request.

    transformers' DynamicLayer re-concatenates the entire cache on every decoding step (35-55% of
    CPU decode time measured here); a StaticLayer avoids that but attends over its full capacity
    every step. This layer writes in place and exposes only the filled columns to attention.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (*key_states.shape[:2], self.capacity)
        self.adopt(
            key_states.new_zeros((*shape, key_states.shape[-1])),
            value_states.new_zeros((*shape, value_states.shape[-1])),
            0,
        )

    def adopt(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> None:
        """Take over buffers whose first ``length`` columns are already filled."""
        self.k_buf, self.v_buf, self.length = k_buf, v_buf, length
        self.capacity = k_buf.shape[2]
        self.dtype, self.device = k_buf.dtype, k_buf.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        self.k_buf[:, :, self.length : end] = key_states
        self.v_buf[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.k_buf = self.k_buf.index_select(0, beam_idx)
            self.v_buf = self.v_buf.index_select(0, beam_idx)
            self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the rollout cache never crops")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("use reorder_cache with a repeated index")


@dataclass
class _Batch:
    """Decoding state of a batch of rows whose cache is already filled.

    ``mask`` covers every cached column (1 = visible); ``positions`` is the RoPE position the NEXT
    token of each row gets; ``logits`` are the raw next-token logits of each row.
    """

    cache: Cache
    mask: torch.Tensor  # [rows, kv_len] long
    positions: torch.Tensor  # [rows] long
    logits: torch.Tensor  # [rows, vocab]


@dataclass
class _Retain:
    """What ``_decode`` needs to keep finished rows' KV: each row's prompt and the number of
    prompt columns (decoding columns start there)."""

    prompts: list[list[int]]
    width: int


def _rows(streams: np.ndarray | torch.Generator, first: int, requests: int, n: int) -> np.ndarray | torch.Generator:
    """The per-sample streams of `requests` consecutive requests from request `first` on."""
    return streams if isinstance(streams, torch.Generator) else streams[first * n: (first + requests) * n]


def _chunks(sizes: Sequence[int], limit: int) -> Iterator[range]:
    """Split items (each worth ``sizes[i]`` rows) into consecutive runs of at most ``limit`` rows
    (an item larger than ``limit`` gets a run of its own)."""
    start, rows = 0, 0
    for i, size in enumerate(sizes):
        if i > start and rows + size > limit:
            yield range(start, i)
            start, rows = i, 0
        rows += size
    if start < len(sizes):
        yield range(start, len(sizes))


class HFEngine(RolloutEngine):
    """Transformers rollout engine.

    Args:
        model_path: a ``save_pretrained`` directory (or anything ``from_pretrained`` accepts offline).
        device: torch device; default CUDA if available, else CPU.
        prefix_reuse: reuse prefix KV for branches (False = re-prefill every branch, benchmark only).
        keep_generate_kv: keep the KV of the last ``generate`` call's sequences so the next
            ``generate_branches`` needs no prefill at all; released by that call, the next
            ``generate``, ``update_weights`` or ``close``.
        max_batch_rows: most sequences decoded at once; bigger requests run in consecutive chunks.
        attn_implementation: passed to ``from_pretrained`` ("sdpa" or "eager").
        logprobs: "raw" or "processed" (see `Completion`).
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        max_prompt_len: int | None = None,
        dtype: str = "float32",
        seed: int = 0,
        device: str | torch.device | None = None,
        prefix_reuse: bool = True,
        keep_generate_kv: bool = True,
        max_batch_rows: int = 512,
        attn_implementation: str = "sdpa",
        logprobs: str = "raw",
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.processed_logprobs = check_logprobs_mode(logprobs) == "processed"
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported by the hf engine; use one of {DTYPES.names()}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(dtype), attn_implementation=attn_implementation
        )
        self.model = model.to(self.device).eval()
        config = self.model.config
        check_lengths(max_model_len, max_prompt_len, getattr(config, "max_position_embeddings", None))
        self.max_model_len = max_model_len
        self.max_prompt_len = max_prompt_len
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._weight_shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.prefix_reuse = prefix_reuse
        self.keep_generate_kv = keep_generate_kv
        self.max_batch_rows = max_batch_rows
        self._n_layers = config.get_text_config(decoder=True).num_hidden_layers
        self._pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._kept: dict[tuple[int, ...], RowKV] = {}  # token ids -> their KV, from the last generate()
        self._adapter_base: dict[str, torch.Tensor] = {}  # adapted weights' base values (update_adapter)
        self._closed = False

    # ---- weights ------------------------------------------------------------------------------
    def _load_weights(self, updates: list[tuple[str, torch.Tensor]]) -> None:
        self._kept.clear()  # computed with the old weights
        self._swap_weights(updates, self.version)

    supports_inflight_updates = True

    @torch.no_grad()
    def _swap_weights(self, updates: list[tuple[str, torch.Tensor]], version: int) -> None:
        # unlike `_load_weights`, the caches stay: the sequences in flight continue over them
        targets = self.model.state_dict(keep_vars=True)
        self._adapter_base.clear()  # full weights are the new base of any later adapter
        for name, tensor in updates:
            targets[name].copy_(tensor)

    accepts_adapters = True

    @torch.no_grad()
    def update_adapter(self, factors: Sequence[tuple[str, torch.Tensor, torch.Tensor, float]]) -> None:
        """LoRA factors merged in place: weight = base + (B @ A) * scaling (peft's merge arithmetic, so
        the result equals the learner's merged weights). Only the factors travel; the engine keeps a
        copy of each adapted weight's base value, taken at the first adapter update."""
        self._check_open()
        targets = self.model.state_dict(keep_vars=True)
        unknown = [name for name, *_ in factors if name not in targets]
        if unknown:
            raise ValueError(f"update_adapter got weights the model does not have, e.g. {unknown[:3]}")
        self._kept.clear()
        for name, a, b, scaling in factors:
            weight = targets[name]
            base = self._adapter_base.setdefault(name, weight.detach().clone())
            delta = (b.to(self.device, base.dtype) @ a.to(self.device, base.dtype)) * scaling
            weight.copy_(base + delta)

    def sleep(self) -> None:
        """On a GPU, move the model to host memory until `wake_up` (the learner needs the room)."""
        self._check_open()
        self._kept.clear()
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self._check_open()
        self.model.to(self.device)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._kept.clear()
            self.model = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- generation ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], params: SamplingConfig) -> list[list[Completion]]:
        self._kept.clear()
        return self._sample_prompts(prompts, params, keep=self.keep_generate_kv)

    @torch.inference_mode()
    def _generate_branches(
        self, prefixes: list[list[int]], branches: list[list[Branch]], params: SamplingConfig
    ) -> list[list[list[Completion]]]:
        try:
            if not self.prefix_reuse:
                prompts = [p[: b.cut] + list(b.suffix) for p, brs in zip(prefixes, branches) for b in brs]
                flat = iter(self._sample_prompts(prompts, params, keep=False))
                return [[next(flat) for _ in brs] for brs in branches]

            streams = self._streams(params, sum(len(b) for b in branches))
            out: list[list[list[Completion]]] = []
            done = 0  # branches (requests) served so far
            for idx in _chunks([len(b) * params.n for b in branches], self.max_batch_rows):
                chunk_branches = [branches[i] for i in idx]
                requests = sum(len(b) for b in chunk_branches)
                batch = self._start_branches([prefixes[i] for i in idx], chunk_branches, params.max_new_tokens)
                expand = torch.arange(batch.mask.shape[0], device=self.device).repeat_interleave(params.n)
                rng = _rows(streams, done, requests, params.n)
                flat = iter(self._decode(self._select_rows(batch, expand), params, rng))
                out.extend([[next(flat) for _ in range(params.n)] for _ in brs] for brs in chunk_branches)
                done += requests
            return out
        finally:
            self._kept.clear()  # summaries are the kept KV's only use: free the memory now

    def _sample_prompts(
        self, prompts: list[list[int]], params: SamplingConfig, *, keep: bool
    ) -> list[list[Completion]]:
        streams = self._streams(params, len(prompts))
        out: list[list[Completion]] = []
        for idx in _chunks([params.n] * len(prompts), self.max_batch_rows):
            chunk = [prompts[i] for i in idx]
            batch = self._prefill(chunk, params.max_new_tokens)
            retain = _Retain([p for p in chunk for _ in range(params.n)], batch.mask.shape[1]) if keep else None
            expand = torch.arange(len(idx), device=self.device).repeat_interleave(params.n)
            rng = _rows(streams, idx.start, len(idx), params.n)
            flat = self._decode(self._select_rows(batch, expand), params, rng, retain)
            out.extend(flat[k * params.n : (k + 1) * params.n] for k in range(len(idx)))
        return out

    def _streams(self, params: SamplingConfig, num_requests: int) -> np.ndarray | torch.Generator:
        """A seeded call: one random stream per sample ([requests · n] seeds, request-major), so a
        sample does not depend on its batch or worker; unseeded: the engine's own generator."""
        seeds = params.seeds_for(num_requests)
        return self._generator if seeds is None else sample_seeds(seeds, params.n)

    def _forward(self, input_ids, mask, position_ids, cache) -> torch.Tensor:
        """Run the model on new tokens; returns raw logits of the last position per row."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _new_cache(self, capacity: int) -> Cache:
        return Cache(layers=[_PreallocatedLayer(capacity) for _ in range(self._n_layers)])

    def _prefill(self, prompts: list[list[int]], max_new_tokens: int) -> _Batch:
        """Left-padded prefill of whole prompts, one row per prompt (with the newest weights)."""
        self.poll_weights()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache(width + max_new_tokens)
        logits = self._forward(ids, mask, position_ids, cache)
        return _Batch(cache, mask, mask.sum(-1), logits)

    @staticmethod
    def _row_kv(cache: Cache, row: int, cols: torch.Tensor) -> RowKV:
        """Copy one row's keys/values at the given cache columns."""
        return [(layer.k_buf[row][:, cols], layer.v_buf[row][:, cols]) for layer in cache.layers]

    def _prefix_kv(self, prefixes: list[list[int]], need: list[int]) -> list[RowKV | None]:
        """KV of ``prefix[:need]`` (or longer) per prefix: the kept thinking KV when the prefix is
        a sequence the last ``generate`` produced, else one batched prefill of the missing ones."""
        kv: list[RowKV | None] = []
        for p in prefixes:
            hit = self._kept.get(tuple(p)) or self._kept.get(tuple(p[:-1]))
            kv.append(hit)
        misses = [k for k, (hit, n) in enumerate(zip(kv, need)) if hit is None and n > 0]
        if misses:
            batch = self._prefill([prefixes[k][: need[k]] for k in misses], 0)
            for j, k in enumerate(misses):
                kv[k] = self._row_kv(batch.cache, j, batch.mask[j].nonzero().flatten())
        return kv

    def _start_branches(self, prefixes: list[list[int]], branches: list[list[Branch]], max_new_tokens: int) -> _Batch:
        """One row per branch: the prefix KV cut at the branch's cut, then the suffix tokens fed;
        returns the batch ready to sample each branch's first token."""
        self.poll_weights()
        # A branch needs next-token logits at its end, so at least its last prompt token must be
        # fed: an empty suffix re-feeds the token before the cut (cut >= 1: empty prompts are rejected).
        targets = [[b.cut if b.suffix else b.cut - 1 for b in brs] for brs in branches]
        kv = self._prefix_kv(prefixes, [max(t, default=0) for t in targets])

        rows: list[tuple[int, int, list[int]]] = []  # (prefix, columns taken from its KV, tokens to feed)
        for k, (prefix, brs) in enumerate(zip(prefixes, branches)):
            have = kv[k][0][0].shape[1] if kv[k] is not None else 0
            for b, target in zip(brs, targets[k]):
                c = min(target, have)
                rows.append((k, c, prefix[c : b.cut] + list(b.suffix)))

        width = max(c for _, c, _ in rows)
        s_width = max(len(s) for _, _, s in rows)
        cache = self._new_cache(width + s_width + max_new_tokens)
        row_mask = torch.zeros((len(rows), width), dtype=torch.long, device=self.device)
        if width > 0:
            # Right-align each row's kept columns at the prefix/suffix boundary (left padding).
            for layer_idx, layer in enumerate(cache.layers):
                k0, v0 = next(x for x in kv if x is not None)[layer_idx]
                k_buf = k0.new_zeros((len(rows), k0.shape[0], layer.capacity, k0.shape[2]))
                v_buf = v0.new_zeros((len(rows), v0.shape[0], layer.capacity, v0.shape[2]))
                for r, (k, c, _) in enumerate(rows):
                    if c:
                        k_buf[r, :, width - c : width] = kv[k][layer_idx][0][:, :c]
                        v_buf[r, :, width - c : width] = kv[k][layer_idx][1][:, :c]
                layer.adopt(k_buf, v_buf, width)
            for r, (_, c, _) in enumerate(rows):
                row_mask[r, width - c :] = 1

        # Tokens to feed, right-aligned so the last column is every row's last prompt token.
        s_ids = torch.full((len(rows), s_width), self._pad_id, dtype=torch.long)
        s_mask = torch.zeros((len(rows), s_width), dtype=torch.long)
        s_pos = torch.zeros((len(rows), s_width), dtype=torch.long)
        for r, (_, c, feed) in enumerate(rows):
            s_ids[r, s_width - len(feed) :] = torch.tensor(feed, dtype=torch.long)
            s_mask[r, s_width - len(feed) :] = 1
            s_pos[r, s_width - len(feed) :] = torch.arange(c, c + len(feed))
        mask = torch.cat([row_mask, s_mask.to(self.device)], dim=1)
        logits = self._forward(s_ids.to(self.device), mask, s_pos.to(self.device), cache)
        positions = torch.tensor([c + len(f) for _, c, f in rows], dtype=torch.long, device=self.device)
        return _Batch(cache, mask, positions, logits)

    def _select_rows(self, batch: _Batch, index: torch.Tensor) -> _Batch:
        """Keep / repeat rows of a batch (cache included) by index."""
        batch.cache.reorder_cache(index)
        return _Batch(batch.cache, batch.mask[index], batch.positions[index], batch.logits[index])

    def _sample(self, logits: torch.Tensor, params: SamplingConfig, rng: np.ndarray | torch.Generator, step: int):
        """Pick next tokens; return (tokens, their raw or processed logprobs). With per-row streams
        each row inverts its own CDF at its stream's uniform for this token position."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        if params.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

            scores = TemperatureLogitsWarper(params.temperature)(None, logits)
            if params.top_p < 1.0:
                scores = TopPLogitsWarper(params.top_p)(None, scores)
            probs = torch.softmax(scores, dim=-1)
            if isinstance(rng, torch.Generator):
                tokens = torch.multinomial(probs, 1, generator=rng).squeeze(-1)
            else:
                cdf = probs.double().cumsum(-1)
                u = torch.from_numpy(uniforms(rng, step)).to(cdf.device)[:, None] * cdf[:, -1:]
                tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)
            if self.processed_logprobs:
                logprobs = torch.log_softmax(scores, dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def _keep_rows(
        self, batch: _Batch, rows: list[int], live: list[int], token_ids: list[list[int]], retain: _Retain
    ) -> None:
        """Keep the KV of finished rows: their prompt columns plus one column per generated token
        but the last (which was sampled, never fed)."""
        for b in rows:
            r = live[b]
            fed = len(token_ids[r]) - 1
            prompt_cols = batch.mask[b, : retain.width].nonzero().flatten()
            gen_cols = torch.arange(retain.width, retain.width + fed, device=self.device)
            key = tuple(retain.prompts[r] + token_ids[r][:-1])
            self._kept[key] = self._row_kv(batch.cache, b, torch.cat([prompt_cols, gen_cols]))

    def _decode(
        self, batch: _Batch, params: SamplingConfig, rng: np.ndarray | torch.Generator, retain: _Retain | None = None
    ) -> list[Completion]:
        """Sampling loop; rows that finish are dropped from the batch once enough have finished
        that compacting the cache pays for its copy."""
        n_rows = batch.mask.shape[0]
        token_ids: list[list[int]] = [[] for _ in range(n_rows)]
        logprobs: list[list[float]] = [[] for _ in range(n_rows)]
        versions: list[list[int]] = [[] for _ in range(n_rows)]
        logits_version = self.version   # the weights that computed `batch.logits`
        finish: list[str] = ["length"] * n_rows
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        live = torch.arange(n_rows, device=self.device)  # original row of each batch row
        done = torch.zeros(n_rows, dtype=torch.bool, device=self.device)  # per batch row

        for step in range(params.max_new_tokens):
            tokens, lps = self._sample(batch.logits, params, rng, step)
            rows_cpu, tok_cpu, lp_cpu, done_cpu = live.tolist(), tokens.tolist(), lps.tolist(), done.tolist()
            for b, r in enumerate(rows_cpu):
                if not done_cpu[b]:
                    token_ids[r].append(tok_cpu[b])
                    logprobs[r].append(lp_cpu[b])
                    versions[r].append(logits_version)
            if stop.numel():
                hit = torch.isin(tokens, stop) & ~done
                for b in hit.nonzero().flatten().tolist():
                    finish[rows_cpu[b]] = "stop"
                done |= hit
            if step == params.max_new_tokens - 1 or bool(done.all()):
                break
            n_done = int(done.sum())
            if n_done and n_done * 4 >= done.numel():
                if retain is not None:
                    self._keep_rows(batch, done.nonzero().flatten().tolist(), rows_cpu, token_ids, retain)
                keep = (~done).nonzero().flatten()
                batch = self._select_rows(batch, keep)
                if isinstance(rng, np.ndarray):
                    rng = rng[keep.cpu().numpy()]
                tokens, live, done = tokens[keep], live[keep], done[keep]
            ones = torch.ones((tokens.shape[0], 1), dtype=batch.mask.dtype, device=self.device)
            mask = torch.cat([batch.mask, ones], dim=1)
            self.poll_weights()
            logits_version = self.version
            logits = self._forward(tokens[:, None], mask, batch.positions[:, None], batch.cache)
            batch = _Batch(batch.cache, mask, batch.positions + 1, logits)
        if retain is not None:
            self._keep_rows(batch, list(range(len(live))), live.tolist(), token_ids, retain)
        return [Completion(t, lp, f, v) for t, lp, f, v in zip(token_ids, logprobs, finish, versions)]
