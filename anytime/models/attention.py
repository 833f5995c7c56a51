"""Attention inputs of tree-packed token rows: position ids and the attention mask, built per
micro-batch from a per-token "hidden key span".

A tree-packed row holds one thinking trace (prompt + thinking, the trunk) followed by its summary
branches (inserted tokens + summary), each branching off the trunk at its cut. Token q of a row
sees the keys k <= q except those in [skip_start[q], skip_end[q]): for a branch token that span is
the thinking past the branch's cut and every branch laid out before it; for trunk tokens it is
empty (0, 0), i.e. plain causal attention. This is the official implementation's per-token
1-D "invalid slice"; a 2-D mask is only materialised for one micro-batch at a time.

A branch token's position id continues from its cut: q - (skip_end[q] - skip_start[q]).

How the mask is materialised depends on the model's attention implementation, which the learners
choose by device (`packed_attn_implementation`): FlexAttention (a `BlockMask`, which also skips
fully hidden blocks) on CUDA; on the CPU, where FlexAttention has no backward, a dense additive
4-D mask through SDPA (or eager attention). The dense mask is additive (0 / dtype min) rather than
boolean: SDPA converts a boolean mask to an additive one inside every layer and keeps each copy
for the backward, while one additive mask is shared by all layers.
"""

from __future__ import annotations

from typing import Any

import torch


def packed_attn_implementation(device: torch.device | str) -> str | None:
    """The attention implementation a learner switches its model to for tree-packed rows on
    `device` (None: keep the model's own, which gets a dense mask)."""
    return "flex_attention" if torch.device(device).type == "cuda" else None


def has_branches(skip_end: torch.Tensor) -> bool:
    """Whether any token of these rows is a branch token (its span ends at its branch's start, > 0)."""
    return bool(skip_end.any())


def position_ids(skip_start: torch.Tensor, skip_end: torch.Tensor) -> torch.Tensor:
    """[R, T] positions: the column index on the trunk; on a branch, the cut plus the offset into the branch."""
    columns = torch.arange(skip_start.shape[1], device=skip_start.device)
    return (columns - (skip_end - skip_start)).long()


def visible(skip_start: torch.Tensor, skip_end: torch.Tensor) -> torch.Tensor:
    """[R, T, T] bool: may query q attend to key k."""
    T = skip_start.shape[1]
    k = torch.arange(T, device=skip_start.device)
    causal = k[None, :] <= k[:, None]
    hidden = (k[None, None, :] >= skip_start[:, :, None]) & (k[None, None, :] < skip_end[:, :, None])
    return causal[None] & ~hidden


def dense_mask(skip_start: torch.Tensor, skip_end: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, T, T] additive mask (0 where visible, the dtype's minimum elsewhere)."""
    allowed = visible(skip_start, skip_end)
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def block_mask(skip_start: torch.Tensor, skip_end: torch.Tensor) -> Any:
    """The same mask as a FlexAttention `BlockMask` (blocks the mask hides entirely are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    start, end = skip_start.int(), skip_end.int()

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & ((kv < start[b, q]) | (kv >= end[b, q]))

    R, T = skip_start.shape
    return create_block_mask(mask_mod, B=R, H=None, Q_LEN=T, KV_LEN=T, device=skip_start.device)


def attention_inputs(input_ids: torch.Tensor, lengths: torch.Tensor, skip_start: torch.Tensor,
                     skip_end: torch.Tensor, config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """`attention_mask` and `position_ids` for a HF decoder over these rows. Rows without branches
    get the usual 2-D padding mask (and the model's own causal masking); tree-packed rows get a
    4-D mask (a `BlockMask` under FlexAttention) and their position ids."""
    device = input_ids.device
    if not has_branches(skip_end):
        padding = torch.arange(input_ids.shape[1], device=device) < lengths.to(device)[:, None]
        return {"attention_mask": padding.long(), "position_ids": None}
    skip_start, skip_end = skip_start.to(device), skip_end.to(device)
    if getattr(config, "_attn_implementation", None) == "flex_attention":
        mask = block_mask(skip_start, skip_end)
    else:
        mask = dense_mask(skip_start, skip_end, dtype)
    return {"attention_mask": mask, "position_ids": position_ids(skip_start, skip_end)}
