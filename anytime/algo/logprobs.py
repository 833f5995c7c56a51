"""Per-token log-probabilities and entropies: from logits, and from hidden states through the LM
head in chunks of tokens, so a learner never holds the [tokens × vocabulary] logits (or their
log-softmax, or their gradient) of more than one chunk. Optionally under the processing the engine
sampled with (`SamplingProcessing`: temperature, then top-p), so learner and engine log-probs are
those of the distribution the tokens were really drawn from (`rollout.logprobs: processed`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingProcessing:
    """Temperature and top-p of each kind of sampled token (thinking, summary): the learner applies
    them as the engines do (vLLM's `processed_logprobs`, transformers' warpers): logits / T, then the
    smallest tokens whose ascending cumulative probability stays within 1 - top_p are removed and
    the rest renormalised."""

    thinking_temperature: float
    thinking_top_p: float
    summary_temperature: float
    summary_top_p: float

    def per_token(self, thinking_mask: torch.Tensor, summary_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperature, top_p) of every target position [R, T-1]: the summary's on summary tokens,
        the thinking's elsewhere (positions never trained take it too; their values are unused)."""
        temperature = torch.where(summary_mask, self.summary_temperature, self.thinking_temperature)
        top_p = torch.where(summary_mask, self.summary_top_p, self.thinking_top_p)
        return temperature.float(), top_p.float()


def processed_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """`logits [n, V]` divided by each row's temperature `[n]`, tokens outside each row's top-p
    nucleus `[n]` set to -inf (transformers' `TopPLogitsWarper` rule, which vLLM shares). `keep [n]`:
    a token per row never removed (the sampled one: it was inside the engine's nucleus, and a
    rounding difference at the nucleus edge must not give it probability 0)."""
    scaled = logits / temperature[:, None].to(logits.dtype)
    cut = top_p < 1.0
    if not bool(cut.any()):
        return scaled
    ascending, order = scaled.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p[:, None].to(cumulative.dtype))
    drop[:, -1] = False   # the most likely token always stays
    drop &= cut[:, None]
    drop = drop.scatter(-1, order, drop)
    if keep is not None:
        drop.scatter_(-1, keep[:, None], False)
    return scaled.masked_fill(drop, float("-inf"))
from torch.utils.checkpoint import checkpoint

# Tokens per LM-head chunk when a caller gives none: 1024 × a 151k vocabulary is 0.6 GB of fp32 logits.
DEFAULT_CHUNK_TOKENS = 1024


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(label | context) for logits `[.., T, V]` and labels `[.., T]` (same positions)."""
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, `[.., T]`."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _head_chunk(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                temperature: float, with_entropy: bool, processing: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
    """[n, 1 or 2]: log-prob (and entropy) of n tokens from their hidden states. One log-softmax
    serves both (at temperature 1, unprocessed), which keeps the chunk's saved tensors to two [n, V]
    ones. `processing`: per-token (temperature, top_p) [n] each, applied instead of `temperature`."""
    logits = head(hidden)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if processing is not None:
        logp = torch.log_softmax(processed_logits(logits, *processing, keep=labels), dim=-1)
    else:
        logp = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lp.unsqueeze(-1)
    if temperature != 1.0 or processing is not None:
        logp = torch.log_softmax(logits, dim=-1)
    return torch.stack([lp, -(logp.exp() * logp).sum(-1)], dim=-1)


def head_chunks(selected: int, chunk_tokens: int) -> int:
    """LM-head calls for `selected` tokens in chunks of `chunk_tokens` (at least one)."""
    return max(1, -(-selected // max(1, chunk_tokens)))


def selected_logprobs(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                      select: torch.Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0,
                      with_entropy: bool = False, chunks: int | None = None,
                      processing: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) `[R, T]` of `labels [R, T]` given `hidden [R, T, H]` (the state at
    each label's context, i.e. already shifted), computed only where `select` is True (0 elsewhere).

    `head` maps hidden states to logits. The selected tokens go through it `chunk_tokens` at a
    time; under autograd each chunk is checkpointed, so the backward recomputes that chunk's
    logits instead of keeping them: peak memory grows with the chunk, not with tokens × vocabulary.
    Entropy is that of the untempered logits. Per token the result is the unchunked computation's.
    `processing`: (temperature, top_p) `[R, T]` per token (`SamplingProcessing.per_token`), in
    place of the one `temperature`.

    `chunks` (>= `head_chunks(selected, chunk_tokens)`) fixes how many times the head runs, spare
    calls on one state times 0: under ZeRO-3 every head call gathers its weight, a collective, so
    data-parallel ranks must make the same number of calls (and all of them must reach the head's
    weight in the backward, even with nothing selected).
    """
    rows = select.nonzero(as_tuple=True)
    states, targets = hidden[rows], labels[rows]
    per_token = None if processing is None else (processing[0][rows], processing[1][rows])
    size = max(1, chunk_tokens)
    calls = max(head_chunks(states.shape[0], size), chunks or 0)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    spare = (hidden.reshape(-1, hidden.shape[-1])[:1], labels.reshape(-1)[:1])
    parts, idle = [], []
    ones = (hidden.new_ones(1, dtype=torch.float32),) * 2
    for k in range(calls):
        piece = (states[k * size:(k + 1) * size], targets[k * size:(k + 1) * size])
        chunk = None if per_token is None else tuple(t[k * size:(k + 1) * size] for t in per_token)
        empty = piece[0].shape[0] == 0
        if empty:
            piece, chunk = spare, (None if per_token is None else ones)
        if grad:
            value = checkpoint(_head_chunk, head, *piece, temperature, with_entropy, chunk, use_reentrant=False,
                               preserve_rng_state=False)
        else:
            value = _head_chunk(head, *piece, temperature, with_entropy, chunk)
        (idle if empty else parts).append(value)
    width = 2 if with_entropy else 1
    dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    values = torch.cat(parts) if parts else hidden.new_zeros((0, width), dtype=dtype)
    out = values.new_zeros((*select.shape, width)).index_put(rows, values)
    if idle and grad:  # keep the spare calls in the graph: their (zero) gradients reach the head's weight
        out = out + 0.0 * torch.stack([v.sum() for v in idle]).sum()
    return out[..., 0], (out[..., 1] if with_entropy else None)
