"""Cut a Hugging Face decoder-only causal LM (Qwen2, Llama and their look-alikes) into pipeline stages.

Stage 0 owns the token embedding, the last stage owns the final norm and the LM head (the loss
runs there), and the decoder layers are spread as evenly as possible over all stages. Every
stage with decoder layers recomputes the rotary embeddings and the attention mask for its
microbatch (cheap, and it keeps the p2p payload to the hidden states alone). Stages keep the
original parameter objects, so `stage.original_name()` maps their names back to the full
model's state-dict keys (checkpoints, weight sync to the rollout engine, tests).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from anytime.algo.logprobs import DEFAULT_CHUNK_TOKENS, selected_logprobs

SUPPORTED_HINT = "a decoder-only HF causal LM laid out like Qwen2/Llama (model.embed_tokens, model.layers, " \
                 "model.norm, model.rotary_emb, lm_head)"


def balanced_layer_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: as even as possible; the remainder goes to the middle stages first
    because the first and last stages also carry the embedding and the LM head."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    ends = [0, num_stages - 1] if num_stages > 1 else [0]
    order = list(range(1, num_stages - 1)) + ends
    for s in order[:extra]:
        counts[s] += 1
    return counts


def load_causal_lm(source, *, dtype: torch.dtype | None = None, seed: int = 0,
                   attn_implementation: str | None = None) -> nn.Module:
    """A causal LM from a path/hub id, a `PretrainedConfig` (random init from `seed`) or a model."""
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if isinstance(source, PreTrainedModel):
        model = source
    elif isinstance(source, PretrainedConfig):
        torch.manual_seed(seed)
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_config(source, dtype=dtype, **kwargs)
    elif isinstance(source, str):
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    else:
        raise TypeError(f"model must be a path, a transformers PretrainedConfig or a PreTrainedModel, "
                         f"got {type(source).__name__}")
    if dtype is not None:
        model = model.to(dtype)
    _check_layout(model)
    return model


def _check_layout(model: nn.Module) -> None:
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, n) for n in needed) or not hasattr(model, "lm_head"):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"cannot partition model type {kind!r}: expected {SUPPORTED_HINT}")


def tied_embeddings(model: nn.Module) -> bool:
    """True when the LM head reuses the input embedding matrix."""
    return model.lm_head.weight is model.model.embed_tokens.weight


class CausalLMStage(nn.Module):
    """One pipeline stage: [embedding] → decoder layers → [final norm → LM head].

    forward(x, attention_mask, position_ids): x is token ids on stage 0 and hidden states
    elsewhere; returns hidden states, or logits on the last stage. `attention_mask` is a 2-D
    padding mask or a prepared 4-D one (tree-packed rows, `anytime.models.attention`). Given `labels`
    (the targets of columns 0..T-2), the last stage returns their log-probs (and entropies) as
    [rows, T-1, 1 or 2] instead of logits, computed in chunks of tokens at the columns `select`
    (`anytime.algo.logprobs.selected_logprobs`), so the full logits never exist.
    """

    def __init__(self, config, stage: int, num_stages: int, layers: dict[int, nn.Module], *,
                 embed_tokens: nn.Embedding | None, norm: nn.Module | None, lm_head: nn.Module | None,
                 rotary_emb: nn.Module) -> None:
        super().__init__()
        self.config, self.stage, self.num_stages = config, stage, num_stages
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})
        self.norm, self.lm_head = norm, lm_head
        self.rotary_emb = rotary_emb
        self.layer_types = [self._layer_type(i) for i in layers]

    def _layer_type(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[index] if types else "full_attention"

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @staticmethod
    def original_name(name: str) -> str:
        """Local parameter name → the full model's state-dict key."""
        return name if name.startswith("lm_head.") else f"model.{name}"

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                select: torch.Tensor | None = None, with_entropy: bool = False,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        if len(self.layers):
            if position_ids is None:
                position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            masks = self._masks(hidden, attention_mask, position_ids)
            position_embeddings = self.rotary_emb(hidden, position_ids)
            for layer, kind in zip(self.layers.values(), self.layer_types):
                hidden = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                               position_ids=position_ids)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None and labels is not None:
            select = torch.ones_like(labels, dtype=torch.bool) if select is None else select
            lp, entropy = selected_logprobs(hidden[:, :-1], self._head, labels, select, chunk_tokens=chunk_tokens,
                                            temperature=temperature, with_entropy=with_entropy)
            return lp.unsqueeze(-1) if entropy is None else torch.stack([lp, entropy], dim=-1)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        # The plain GEMM, not the (Split)Linear module: the checkpointed chunks recompute it in the
        # backward, outside the forward's WeightGradStore recording, so its weight gradient is
        # computed right there instead of being deferred to a W action.
        return F.linear(hidden, self.lm_head.weight, self.lm_head.bias)

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kwargs = {"config": self.config, "inputs_embeds": hidden, "attention_mask": attention_mask,
                      "past_key_values": None, "position_ids": position_ids}
        masks = {}
        if "full_attention" in self.layer_types:
            masks["full_attention"] = create_causal_mask(**kwargs)
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks


@dataclass(frozen=True)
class StageLayout:
    """Which decoder layers each stage holds (layer indices of the full model)."""

    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, num_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None) -> StageLayout:
        counts = list(layers_per_stage) if layers_per_stage is not None \
            else balanced_layer_split(num_layers, num_stages)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(f"layers_per_stage={counts} must have {num_stages} non-negative entries summing to "
                             f"the model's {num_layers} layers")
        starts = [sum(counts[:s]) for s in range(num_stages)]
        return cls(tuple(tuple(range(a, a + c)) for a, c in zip(starts, counts)))


def build_stages(model: nn.Module, stages: Iterable[int], num_stages: int,
                 layers_per_stage: Sequence[int] | None = None) -> dict[int, CausalLMStage]:
    """Stage modules for the stage ids in `stages`, sharing parameters with `model`.

    Tied input/output embeddings stay one Parameter when stage 0 and the last stage are both
    built here (V placement); across ranks the two copies are summed by the executor.
    """
    _check_layout(model)
    body = model.model
    layout = StageLayout.build(len(body.layers), num_stages, layers_per_stage)
    out = {}
    for s in sorted(set(stages)):
        if not 0 <= s < num_stages:
            raise ValueError(f"stage {s} out of range for {num_stages} stages")
        last = s == num_stages - 1
        out[s] = CausalLMStage(
            model.config, s, num_stages, {i: body.layers[i] for i in layout.layers[s]},
            embed_tokens=body.embed_tokens if s == 0 else None,
            norm=body.norm if last else None, lm_head=model.lm_head if last else None,
            rotary_emb=body.rotary_emb)
    return out
