"""A HF causal LM split into pipeline stages over the ranks of a process group: the stage-level
runtime that trains it with the RL policy loss on any schedule of `anytime.pipeline.schedule`, one
optimizer per rank. (`anytime.learner.pipeline_learner.PipelineLearner` is the RL learner built on it.)

`PipelineExecutor` (runtime.py) runs the schedule; this module owns what sits around it: building
the stages, the per-microbatch policy loss on the last stage, the post-validated optimizer step,
pipelined log-probs, and the weights under the full model's names (checkpoints, weight sync).

Batches may carry tree-packed rows (`skip_start`/`skip_end`, see `anytime.models.attention`): every
stage gets its microbatch's position ids and 4-D mask through the stage kwargs. The last stage
turns its hidden states into log-probs in chunks of tokens (no full logits), at the trained
tokens in training and at every column for `logprobs` (rows may be left-padded here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from anytime.algo.logprobs import DEFAULT_CHUNK_TOKENS
from anytime.algo.loss import WEIGHTED_STATS, LossSpec, masked_token_loss
from anytime.core.dist import sum_gradients
from anytime.models.attention import attention_inputs, has_branches
from anytime.pipeline.runtime import PipelineExecutor
from anytime.pipeline.schedule import Schedule

# Loss statistics summed over microbatches (the token-weighted ones divided by tokens at the end);
# they ride on the post-validation all-reduce, so their order is fixed.
# The reference-model KL is not among them: the pipelined learner takes no reference model.
_WEIGHTED = tuple(k for k in WEIGHTED_STATS if k != "kl_ref")
_EXTRAS = ("loss", "tokens", *_WEIGHTED)


def _field(batch, name: str, required: bool = True):
    value = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    if value is None and required:
        raise ValueError(f"batch has no {name!r}; a pipeline train batch needs input_ids, attention_mask, "
                         f"loss_mask, advantages and old_logprobs")
    return value


def _targets(t: torch.Tensor, rows: int, length: int, name: str) -> torch.Tensor:
    """Per-token tensors may be target-aligned [R, T-1] or input-aligned [R, T] (column 0 dropped)."""
    if t.shape == (rows, length - 1):
        return t
    if t.shape == (rows, length):
        return t[:, 1:]
    raise ValueError(f"batch[{name!r}] has shape {tuple(t.shape)}; expected [{rows}, {length - 1}] "
                     f"(aligned with input_ids[:, 1:]) or [{rows}, {length}]")


class PipelinedCausalLM:
    """A HF causal LM split over the ranks of `group`, trained with the policy-gradient loss.

    Every rank of the pipeline group builds it with the same arguments and calls the same
    methods with the same batch (the batch is small next to the model; each stage takes what it
    needs). `train_step(batch)` = forward/backward of all microbatches on the schedule + an
    optimizer step with post-validated global clipping; `logprobs(batch)` = a forward-only
    pipelined pass returning per-token log-probs of input_ids[:, 1:].

    `loss_kwargs` are the fields of `anytime.algo.loss.LossSpec` (agg, clip_low, clip_high, entropy_coef,
    kl_coef, max_len, and the normalisers num_tokens / num_rows, which default to the batch's own
    totals); `train_step` and `forward_backward` take per-call overrides, e.g. the totals of a
    PPO mini-batch.

    On a (pipeline × data-parallel) mesh, `group` is this replica's pipeline, `dp_group` the
    ranks holding the same stages in the other replicas (their gradients are summed before the
    step), and `reverse_group` the pipeline's second point-to-point group on NCCL (built for
    every pipeline by `anytime.learner.mesh`).
    """

    def __init__(self, model, schedule: str | Schedule, *, microbatches: int | None = None,
                 chunks: int | None = None,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, seed: int = 0, layers_per_stage: Sequence[int] | None = None,
                 offload_chunks: Iterable[int] = (), max_grad_norm: float | None = 1.0,
                 post_validate: bool = True, rollback: str = "auto", loss_kwargs: Mapping | None = None,
                 temperature: float = 1.0, prefetch: int = 2, attn_implementation: str | None = None,
                 logprob_chunk_tokens: int | None = None, dp_group: dist.ProcessGroup | None = None,
                 reverse_group: dist.ProcessGroup | None = None) -> None:
        from anytime.pipeline.partition import (
            build_stages,
            load_causal_lm,
            tied_embeddings,
        )
        from anytime.pipeline.schedule import build_schedule

        if not dist.is_initialized():
            raise ValueError("PipelinedCausalLM needs an initialised torch.distributed process group")
        ranks = dist.get_world_size(group)
        if isinstance(schedule, str):
            if microbatches is None:
                raise ValueError("pass microbatches= when the schedule is given by name")
            schedule = build_schedule(schedule, ranks, microbatches, chunks)
        elif microbatches is not None and microbatches != schedule.microbatches:
            raise ValueError(f"microbatches={microbatches} disagrees with the schedule's {schedule.microbatches}")
        self.schedule, self.group, self.dp_group = schedule, group, dp_group
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.temperature, self.loss_kwargs = temperature, dict(loss_kwargs or {})
        self.chunk_tokens = logprob_chunk_tokens or DEFAULT_CHUNK_TOKENS
        full = load_causal_lm(model, dtype=dtype, seed=seed, attn_implementation=attn_implementation)
        self.config = full.config
        self.tied = tied = tied_embeddings(full)
        rank, last = dist.get_rank(group), schedule.stages - 1
        mine = [s for s, r in enumerate(schedule.placement) if r == rank]
        stages = build_stages(full, mine, schedule.stages, layers_per_stage)
        del full  # the layers of other ranks' stages are freed with it
        for module in stages.values():
            module.to(self.device)
        pairs = [((0, "embed_tokens.weight"), (last, "lm_head.weight"))] if tied else []
        self.executor = PipelineExecutor(stages, schedule, group=group, reverse_group=reverse_group,
                                         device=self.device, offload_chunks=offload_chunks, prefetch=prefetch,
                                         tied=pairs)
        self.last_rank = schedule.placement[last]
        self.params = list({id(p): p for _, p in self.named_parameters()}.values())
        # A tied weight held by two ranks carries the same summed gradient on both: count it once.
        skip = {id(stages[last].lm_head.weight)} if tied and schedule.placement[0] != rank and last in stages else set()
        self.optimizer, self.validator = self._build_optimizer(
            [p for p in self.params if id(p) not in skip], optimizer_factory=optimizer_factory,
            max_grad_norm=max_grad_norm, post_validate=post_validate, rollback=rollback)
        self.dtype = next(p.dtype for _, p in self.named_parameters() if p.is_floating_point())
        self._pending_metrics: dict = {}
        self.last_metrics: dict = {}
        self._layout: list[list[tuple[str, tuple[int, ...], torch.dtype]]] | None = None

    def _build_optimizer(self, norm_params: list[nn.Parameter], *, optimizer_factory, max_grad_norm: float | None,
                         post_validate: bool, rollback: str):
        """(optimizer of `self.params`, the object that steps it): here a PyTorch optimizer and its
        `PostValidator`; `anytime.learner.deepspeed_stage` steps a DeepSpeed engine instead.
        `norm_params` are the weights whose gradients count toward the global norm."""
        from anytime.pipeline.postvalidate import PostValidator

        factory = optimizer_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-6))
        optimizer = factory(self.params)
        return optimizer, PostValidator(optimizer, norm_params, max_grad_norm=max_grad_norm, group=self.group,
                                        enabled=post_validate, rollback=rollback)

    # -- weights --------------------------------------------------------------------------------
    def named_parameters(self):
        """(full-model name, parameter) for the weights this rank holds (a shared tied weight once)."""
        seen = set()
        for module in self.executor.stages.values():
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield module.original_name(name), p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under the full model's state-dict keys (for checkpoints and weight sync)."""
        return {name: p.detach() for name, p in self.named_parameters()}

    def train(self, mode: bool = True) -> None:
        """Training / eval mode of this rank's stage modules (dropout, as `nn.Module.train`)."""
        for module in self.executor.stages.values():
            module.train(mode)

    def _gather_layout(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """Per rank: (name, shape, dtype) of the weights it holds; fixed after construction, so asked once."""
        if self._layout is None:
            mine = [(n, tuple(p.shape), p.dtype) for n, p in self.named_parameters()]
            layout: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(layout, mine, group=self.group)
            self._layout = layout
        return self._layout

    def full_state_dict(self, dst: int | None = 0) -> dict[str, torch.Tensor]:
        """The whole model's weights under HF names, gathered on pipeline rank `dst` (on every rank
        with dst=None); other ranks get only their own. Collective: every rank must call it.

        Each rank sends one flat buffer per dtype, so the cost is a message per rank, not per tensor.
        """
        layout = self._gather_layout()
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        own = self.state_dict()
        out: dict[str, torch.Tensor] = {}
        for src in range(world):
            for dtype in sorted({d for _, _, d in layout[src]}, key=str):
                entries = [(n, shape) for n, shape, d in layout[src] if d == dtype]
                if rank == src:
                    out.update((n, own[n]) for n, _ in entries)
                    if dst is not None and dst == src:
                        continue
                    flat = torch.cat([own[n].reshape(-1) for n, _ in entries])
                    if dst is None:
                        dist.broadcast(flat, self._global(src), group=self.group)
                    else:
                        dist.send(flat, self._global(dst), group=self.group)
                elif dst is None or rank == dst:
                    sizes = [math.prod(shape) for _, shape in entries]
                    flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
                    if dst is None:
                        dist.broadcast(flat, self._global(src), group=self.group)
                    else:
                        dist.recv(flat, self._global(src), group=self.group)
                    out.update((n, t.view(shape)) for (n, shape), t in zip(entries, flat.split(sizes)))
        if self.tied and "model.embed_tokens.weight" in out:
            out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
        return out

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> tuple[list[str], list[str]]:
        """Copy the weights this rank holds from a *full-model* state dict (names of other ranks'
        stages are expected there and ignored). Returns (missing, unexpected) like `nn.Module`:
        the held names the dict lacks (a tied head falls back to the embedding), and []."""
        missing = []
        for name, p in self.named_parameters():
            source = state.get(name)
            if source is None and self.tied and name == "lm_head.weight":
                source = state.get("model.embed_tokens.weight")
            if source is None:
                missing.append(name)
                continue
            if tuple(source.shape) != tuple(p.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(source.shape)} in the state dict but "
                                 f"{tuple(p.shape)} in the model")
            p.copy_(source.to(p.device, p.dtype))
        if strict and missing:
            raise ValueError(f"state dict lacks weights this pipeline rank holds: {missing[:5]}")
        return missing, []

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    # -- batches -------------------------------------------------------------------------------
    def _prepare(self, batch) -> dict:
        ids = _field(batch, "input_ids").to(self.device)
        rows, length = ids.shape
        m = self.schedule.microbatches
        if rows % m:
            raise ValueError(f"batch has {rows} rows, not divisible by microbatches={m}; pad or resize the batch")
        mask = _field(batch, "attention_mask", required=False)
        pos = _field(batch, "position_ids", required=False)
        spans = [_field(batch, name, required=False) for name in ("skip_start", "skip_end")]
        packed = spans[0] is not None and spans[1] is not None and has_branches(spans[1])
        return {"ids": ids, "rows": rows, "length": length, "mb": rows // m,
                "attention_mask": None if mask is None else mask.to(self.device),
                "position_ids": None if pos is None else pos.to(self.device),
                "skip": [t.to(self.device) for t in spans] if packed else None}

    def _kwargs(self, b: dict, last: Callable[[int], dict] | None = None) -> Callable[[int, int], dict]:
        """Per (stage, microbatch): the attention inputs (a tree-packed microbatch's 4-D mask and
        position ids are built once per microbatch and rank, dropped after its last stage here
        used them) plus, for the last stage, `last(microbatch)`."""
        built: dict[int, tuple[dict, int]] = {}
        held = len(self.executor.stages)
        final = self.schedule.stages - 1

        def attention(j: int) -> dict:
            r = slice(j * b["mb"], (j + 1) * b["mb"])
            if b["skip"] is None:
                return {"attention_mask": None if b["attention_mask"] is None else b["attention_mask"][r],
                        "position_ids": None if b["position_ids"] is None else b["position_ids"][r]}
            ids, mask = b["ids"][r], b["attention_mask"]
            lengths = mask[r].sum(-1) if mask is not None and mask.dim() == 2 else torch.full((len(ids),), ids.shape[1])
            return attention_inputs(ids, lengths, b["skip"][0][r], b["skip"][1][r], self.config, self.dtype)

        def stage_kwargs(stage: int, j: int) -> dict:
            kwargs, uses = built.pop(j, None) or (attention(j), 0)
            if uses + 1 < held:
                built[j] = (kwargs, uses + 1)
            return {**kwargs, **(last(j) if last is not None and stage == final else {})}
        return stage_kwargs

    def _head_kwargs(self, b: dict, select: torch.Tensor, with_entropy: bool = False) -> Callable[[int], dict]:
        """The last stage's arguments for microbatch j: log-probs of `labels` at the `select` columns."""
        labels = b["ids"][:, 1:]

        def last(j: int) -> dict:
            r = slice(j * b["mb"], (j + 1) * b["mb"])
            return {"labels": labels[r], "select": select[r], "with_entropy": with_entropy,
                    "chunk_tokens": self.chunk_tokens, "temperature": self.temperature}
        return last

    def _boundary(self, b: dict) -> tuple[tuple[int, ...], torch.dtype]:
        return (b["mb"], b["length"], self.config.hidden_size), self.dtype

    # -- training ------------------------------------------------------------------------------
    def forward_backward(self, batch, *, loss_kwargs: Mapping | None = None, entropy: bool = False) -> dict:
        """Forward and backward of every microbatch; gradients end up in `.grad` (before clipping).

        `entropy=True` also reports the mean token entropy (computed anyway when entropy_coef != 0);
        an optional `ref_logprobs` field of the batch feeds the KL term (kl_coef in loss_kwargs).
        """
        if self.validator.pending:
            self.validate()
        b = self._prepare(batch)
        rows, length = b["rows"], b["length"]
        loss_mask = _targets(_field(batch, "loss_mask"), rows, length, "loss_mask").to(self.device)
        adv = _targets(_field(batch, "advantages"), rows, length, "advantages").to(self.device)
        old = _targets(_field(batch, "old_logprobs"), rows, length, "old_logprobs").to(self.device)
        ref = _field(batch, "ref_logprobs", required=False)
        ref = None if ref is None else _targets(ref, rows, length, "ref_logprobs").to(self.device)
        kwargs = {**self.loss_kwargs, **(loss_kwargs or {})}
        agg = kwargs.get("agg", "token-mean")
        # Defaults: this batch's own totals (summed microbatch losses = the full-batch loss).
        kwargs.setdefault("num_rows", float((loss_mask.sum(-1) > 0).sum()) if agg == "seq-mean-token-mean"
                          else float(rows))
        kwargs.setdefault("num_tokens", float(loss_mask.sum()))
        spec = LossSpec(**kwargs)
        with_entropy = entropy or spec.entropy_coef != 0.0
        # the loss reads only the trained tokens: the last stage's LM head runs on those alone
        last = self._head_kwargs(b, loss_mask > 0, with_entropy)
        segments = None if b["skip"] is None else b["skip"][1][:, 1:]

        def loss_fn(out: torch.Tensor, j: int):
            r = slice(j * b["mb"], (j + 1) * b["mb"])
            lp = out[..., 0]
            return masked_token_loss(lp, old[r], adv[r], loss_mask[r], spec,
                                     ref_logprobs=None if ref is None else ref[r].to(lp.dtype),
                                     entropy=out[..., 1] if with_entropy else None,
                                     segments=None if segments is None else segments[r])

        stats = self.executor.train_step(lambda j: b["ids"][j * b["mb"]:(j + 1) * b["mb"]], loss_fn,
                                         self._boundary(b), stage_kwargs=self._kwargs(b, last))
        outputs = stats.outputs.values()
        tokens = sum(o["tokens"] for o in outputs)
        weighted = {k: sum(o.get(k, 0.0) for o in outputs) for k in _WEIGHTED}
        self._pending_metrics = {"loss": sum(stats.losses), "tokens": tokens, **weighted}
        # `sums`: this rank's loss and token-weighted statistics (non-zero on the last stage only)
        return {"loss": sum(stats.losses) if stats.losses else None, "step_time": stats.wall,
                "peak_saved_bytes": stats.peak_saved_bytes, "sums": dict(self._pending_metrics)}

    def optimizer_step(self) -> None:
        """Speculative step (post-validation) or the blocking clip-then-step when disabled. With
        data-parallel replicas (`dp_group`) the replicas' gradients are summed first, once, after
        the schedule's last W: every replica of a stage then takes the same decisions."""
        if self.dp_group is not None:
            sum_gradients(self.params, self.dp_group)
        pm = self._pending_metrics
        result = self.validator.step([pm.get(k, 0.0) for k in _EXTRAS])
        if result is not None:
            self._finish(result)

    def validate(self) -> dict:
        """Wait for the global gradient state; roll back / redo the step if needed; return metrics
        (those of the last validated step when nothing is pending)."""
        return self._finish(self.validator.validate()) if self.validator.pending else self.last_metrics

    def _finish(self, v) -> dict:
        sums = dict(zip(_EXTRAS, v.extras))
        tokens = sums["tokens"]
        self.last_metrics = {"loss": sums["loss"], "grad_norm": v.grad_norm, "clipped": v.clipped,
                             "skipped": v.skipped, "rolled_back": v.rolled_back, "tokens": tokens,
                             **{k: sums[k] / max(tokens, 1.0) for k in _WEIGHTED}}
        return self.last_metrics

    def train_step(self, batch, *, wait: bool = True, loss_kwargs: Mapping | None = None,
                   entropy: bool = False) -> dict:
        """forward_backward + optimizer step. With wait=False the validation is left pending (it is
        picked up by the next call, or by `validate()`), so ranks are not lined up at the step."""
        metrics = self.forward_backward(batch, loss_kwargs=loss_kwargs, entropy=entropy)
        self.optimizer_step()
        if wait and self.validator.pending:
            self.validate()
        if not self.validator.pending:
            metrics.update(self.last_metrics)
        return metrics

    # -- inference -----------------------------------------------------------------------------
    def logprobs(self, batch, *, broadcast: bool = True) -> torch.Tensor | None:
        """log π(input_ids[:, t+1] | input_ids[:, :t+1]) as [R, T-1]; on every rank with `broadcast`,
        else only on the rank of the last stage (None elsewhere)."""
        if self.validator.pending:
            self.validate()
        b = self._prepare(batch)
        every = torch.ones_like(b["ids"][:, 1:], dtype=torch.bool)  # padding too: rows may be left-padded

        def output_fn(out: torch.Tensor, j: int) -> torch.Tensor:
            return out[..., 0]

        stats = self.executor.forward(lambda j: b["ids"][j * b["mb"]:(j + 1) * b["mb"]], output_fn,
                                      self._boundary(b), stage_kwargs=self._kwargs(b, self._head_kwargs(b, every)))
        rank = dist.get_rank(self.group)
        out = torch.cat([stats.outputs[j] for j in range(self.schedule.microbatches)]) \
            if rank == self.last_rank else None
        if not broadcast:
            return out
        if out is None:
            dtype = self._boundary(b)[1]
            dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            out = torch.empty(b["rows"], b["length"] - 1, dtype=dtype, device=self.device)
        dist.broadcast(out, src=self._global(self.last_rank), group=self.group)
        return out
