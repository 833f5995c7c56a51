"""Data-parallel learners: the whole model on every rank, each rank training the rows of its own
prompts in micro-batches packed by a token budget, gradients summed across ranks (each rank's
loss is its share of the mini-batch loss: the normaliser is global).
`TorchLearner` runs plain PyTorch AdamW; `anytime.learner.deepspeed_learner` runs the same
micro-batch loop on a DeepSpeed ZeRO engine.

Low-precision weights (`model.dtype: bfloat16` or `float16`): the torch learner holds its trainable
weights in float32 (master weights) and runs its forward passes under autocast to that dtype, so
AdamW steps below bf16's rounding of a weight (lr 1e-6 against ~2^-8 relative precision) are kept;
what it hands on as a model (`full_state_dict`: the weight sync and the checkpoint's `model/`) is in
that dtype, and its checkpoint keeps the float32 masters beside the optimizer state.

Rows may be tree-packed (`anytime.batch.packing`): each micro-batch gets its position ids and
attention mask from the rows' hidden key spans. Log-probs come from the decoder's hidden states
through the LM head in chunks of tokens (`anytime.algo.logprobs.selected_logprobs`), only for the
tokens that are needed, so no micro-batch holds its whole [tokens × vocabulary] logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anytime.algo.logprobs import DEFAULT_CHUNK_TOKENS, SamplingProcessing, head_chunks, selected_logprobs
from anytime.algo.loss import LossSpec, token_loss
from anytime.batch.train_batch import TrainBatch
from anytime.core.dist import any_across_ranks, is_main, max_across_ranks, rank_world, sum_gradients
from anytime.core.precision import bf16_enabled, native_bf16
from anytime.core.stats import add_sums
from anytime.learner.base import StepResult
from anytime.learner.lr_schedules import lr_lambda
from anytime.models.attention import attention_inputs, packed_attn_implementation
from anytime.models.loading import check_plain_head

if TYPE_CHECKING:
    from anytime.config import LearnerConfig
    from anytime.learner.lora import AdapterUpdate


def forward_logprobs(model: torch.nn.Module, batch: TrainBatch, select: torch.Tensor | None = None, *,
                     with_entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     chunks: int | None = None, processing: SamplingProcessing | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target-aligned log-probs (and entropies) of a batch's rows, [R, T-1], at the columns
    `select` (default: every column inside a row; 0 elsewhere); `chunks`: LM-head calls (see
    `selected_logprobs`); `processing`: the engine's sampling processing (None: raw log-probs)."""
    check_plain_head(model)
    dtype = next(model.parameters()).dtype
    inputs = attention_inputs(batch.input_ids, batch.lengths, batch.skip_start, batch.skip_end, model.config, dtype)
    hidden = model.get_decoder()(input_ids=batch.input_ids, use_cache=False, **inputs).last_hidden_state
    select = batch.valid_mask if select is None else select
    per_token = None if processing is None else processing.per_token(batch.thinking_mask, batch.summary_mask)
    return selected_logprobs(hidden[:, :-1], model.get_output_embeddings(), batch.labels, select,
                             chunk_tokens=chunk_tokens, with_entropy=with_entropy, chunks=chunks,
                             processing=per_token)


class DataParallelLearner:
    """The micro-batch loop shared by the torch and DeepSpeed learners; subclasses say how a loss
    is backpropagated (`_backward`) and how a step is taken."""

    # `rollout.logprobs: processed`: log-probs under the engine's temperature and top-p (set by the factory)
    processing: SamplingProcessing | None = None

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, ref_model: torch.nn.Module | None = None,
                 peft_model: Any = None):
        # peft_model: the `PeftModel` around `model` when LoRA layers were injected into it
        # (`anytime.learner.lora`); the KL reference is then `model` with the adapter switched off.
        self.model, self.cfg, self.ref_model, self.peft_model = model, cfg, ref_model, peft_model
        self.config = model.config
        self.device = next(model.parameters()).device
        impl = packed_attn_implementation(self.device) if cfg.pack_summaries else None
        for m in (model, ref_model):
            if impl is not None and m is not None:
                m.set_attn_implementation(impl)
        world = rank_world()[1]
        self.dp_size, self.dp_ranks = world, list(range(world))
        # the torch learner's forward autocast (`learner.bf16`, low-precision weights); DeepSpeed's is its engine's own
        self.autocast_dtype: torch.dtype | None = None

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[list[int], TrainBatch]]:
        """(rows, micro-batch) packed by `learner.micro_batch_tokens`; ranks with fewer get empty ones
        (a padding row, no rows of the batch), so every rank runs the same number of forwards
        (ZeRO-3 gathers weights in each, ZeRO reduces gradients in each backward)."""
        groups = batch.micro_batch_rows(self.cfg.micro_batch_tokens)
        micro = [(rows, batch.select(rows)) for rows in groups]
        most = max_across_ranks(len(micro))
        return micro + [([], batch.select([]).with_padding_rows(1))] * (most - len(micro))

    def _forward(self, model: torch.nn.Module, mb: TrainBatch, select: torch.Tensor | None = None,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_logprobs` with as many LM-head calls on every rank (ZeRO-3, see `selected_logprobs`)."""
        chunk = self.cfg.logprob_chunk_tokens
        chosen = mb.valid_mask if select is None else select
        chunks = max_across_ranks(head_chunks(int(chosen.sum()), chunk))
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            return forward_logprobs(model, mb, chosen, with_entropy=with_entropy, chunk_tokens=chunk, chunks=chunks,
                                    processing=self.processing)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        out = torch.zeros(batch.advantages.shape, dtype=torch.float32)
        for rows, micro in self._micro_batches(batch):
            lp, _ = self._forward(self.model, micro.to(self.device))
            if rows:
                out[rows, : lp.shape[1]] = lp.float().cpu()
        self.model.train(was_training)
        return out

    def forward_backward(self, batch: TrainBatch, loss: LossSpec) -> dict[str, float]:
        """Micro-batches packed by `learner.micro_batch_tokens`; ranks with fewer run empty ones, so
        all ranks take the same number of backward passes (ZeRO reduces inside them). A non-finite
        micro-batch loss on any rank stops every rank before its backward."""
        self.model.train()
        micro = self._micro_batches(batch)
        sums: dict[str, float] = {}
        for index, (_, mb) in enumerate(micro):
            mb = mb.to(self.device)
            # the loss reads only the trained tokens: the LM head runs on those alone
            lp, entropy = self._forward(self.model, mb, mb.loss_mask, with_entropy=True)
            ref_lp = None
            if self.ref_model is not None and loss.kl_coef != 0.0:
                with torch.no_grad():
                    ref_lp, _ = self._forward(self.ref_model, mb, mb.loss_mask)
            elif self.peft_model is not None and self.cfg.reference_model and loss.kl_coef != 0.0:
                with torch.no_grad(), self.peft_model.disable_adapter():
                    ref_lp, _ = self._forward(self.model, mb, mb.loss_mask)
            value, part = token_loss(lp, entropy, mb, loss, ref_lp)
            if any_across_ranks(not bool(torch.isfinite(value))):
                return {**sums, "loss": float("nan")}
            self._backward(value, last=index == len(micro) - 1)
            add_sums(sums, part)
        return sums

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def adapter_update(self) -> AdapterUpdate | None:
        """The adapter's factors for an engine that merges them itself (None without LoRA): the
        adapter-sized weight sync (`anytime.rollout.workers.local`)."""
        if self.peft_model is None:
            return None
        from anytime.learner.lora import adapter_update

        return adapter_update(self.model)

    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """Hugging Face-named weights (every rank holds the model); with LoRA, the adapter merged in."""
        if self.peft_model is not None:
            from anytime.learner.lora import merged_state_dict

            return merged_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def _save_adapter(self, folder: Path) -> None:
        if self.peft_model is not None and is_main():
            from anytime.learner.lora import save_adapter

            save_adapter(self.peft_model, folder)

    def _load_model(self, folder: Path) -> None:
        if self.peft_model is not None:
            from anytime.learner.lora import load_adapter

            load_adapter(self.peft_model, folder)
        else:
            from anytime.learner.checkpoint import load_model_weights

            load_model_weights(self.model, folder)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def upcast_to_masters(model: torch.nn.Module) -> tuple[torch.dtype | None, dict[str, torch.nn.Parameter]]:
    """Cast the model's low-precision trainable weights to float32 in place: (their dtype, or None
    when there are none; the upcast parameters by name, a tied weight once). Frozen weights keep
    their dtype (nothing steps them)."""
    masters = {n: p for n, p in model.named_parameters() if p.requires_grad and p.dtype in LOW_PRECISION}
    dtypes = {p.dtype for p in masters.values()}
    if len(dtypes) > 1:
        raise ValueError(f"the trainable weights mix {sorted(map(str, dtypes))}: load the model in one dtype")
    for p in masters.values():
        p.data = p.data.float()   # same Parameter object: ties and hooks hold
    return next(iter(dtypes), None), masters


class TorchLearner(DataParallelLearner):
    """Plain PyTorch: AdamW with an LR schedule; across ranks, gradients are summed at the step.

    A bf16 / fp16 model trains float32 masters of its trainable weights under autocast to its dtype
    (`upcast_to_masters`): weights, gradients and AdamW state of those weights take twice the memory
    of the model's dtype."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_steps: int,
                 ref_model: torch.nn.Module | None = None, peft_model: Any = None):
        super().__init__(model, cfg, ref_model, peft_model)
        self.weights_dtype, self.masters = upcast_to_masters(model)
        # every state-dict name of an upcast weight (a tied weight has two)
        upcast = {id(p) for p in self.masters.values()}
        self._master_keys = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in upcast}
        # `learner.bf16: auto` resolved for this device, as the factory did when it said why (`resolve_bf16`)
        bf16 = bf16_enabled(cfg.bf16, native_bf16(self.device.type))
        self.autocast_dtype = self.weights_dtype or (torch.bfloat16 if bf16 else None)
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps))

    def optimizer_step(self) -> StepResult:
        params = [p for p in self.model.parameters() if p.grad is not None]
        sum_gradients(params)  # each rank's gradient is its share of the mini-batch's (global normaliser)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        lr = self.optimizer.param_groups[0]["lr"]
        if any_across_ranks(not bool(torch.isfinite(norm))):
            self.zero_grad()
            return StepResult(float(norm), True, lr)
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        return StepResult(float(norm), False, lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """The model's weights in its own dtype: float32 masters are rounded to it (with LoRA, the
        merge already casts the adapter's delta to the base weights' dtype)."""
        state = super().full_state_dict(all_ranks)
        if self.weights_dtype is None or self.peft_model is not None:
            return state
        return {k: v.to(self.weights_dtype) if k in self._master_keys else v for k, v in state.items()}

    def save(self, folder: Path) -> None:
        from anytime.learner.checkpoint import save_master_weights

        self._save_adapter(folder)
        if is_main():  # the replicas are identical: one copy
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       folder / "optimizer.pt")
            if self.masters:   # the checkpoint's model/ holds only their rounding to the model's dtype
                save_master_weights(self.masters, folder)

    def load(self, folder: Path) -> None:
        from anytime.learner.checkpoint import load_master_weights, load_tensors

        self._load_model(folder)
        if self.masters:
            load_master_weights(self.masters, folder)
        state = load_tensors(folder / "optimizer.pt")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
