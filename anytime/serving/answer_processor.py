"""vLLM's side of the answer protocol (`anytime.serving.protocol`) when a model is served: a logits
processor that vLLM's engine loads by import path (`--logits-processors`, see `anytime serve`).

For requests that set `thinking_token_budget` it forces what vLLM's own thinking budget does not:
the close text's transition phrase just before vLLM forces the end marker (where the budget runs out),
the header after the end marker (forced, or the model's own), and an EOS after `summary_max_tokens`
summary tokens. With vLLM's forced end, a served answer is then the one `anytime eval` scored (see
`anytime.serving.protocol`). It also refuses, with an HTTP 400, a budget that leaves no room for the
answer within `max_tokens`.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from anytime.config.answer_format import encode
from anytime.serving.protocol import AnswerProtocol


class _Tracked:
    """One request's generated ids (vLLM's live list) and where its thinking end was found."""

    __slots__ = ("output", "phrase_at", "scanned", "end_at")

    def __init__(self, output: list[int], phrase_at: int):
        self.output = output
        self.phrase_at = phrase_at   # output position where the transition phrase starts (a cut)
        self.scanned = 0       # output positions already searched for the end marker
        self.end_at = -1       # index just past the first end marker, once found


class AnswerProtocolProcessor(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params) -> None:
        budget, max_tokens = sampling_params.thinking_token_budget, sampling_params.max_tokens
        if budget is not None and max_tokens is not None and budget >= max_tokens:
            raise ValueError(
                f"thinking_token_budget={budget} leaves no room for the answer: this request may generate "
                f"max_tokens={max_tokens} tokens in all (the model's context minus the prompt, unless the request "
                "sets it). Send a smaller budget, or a max_tokens above budget + the close text + the summary.")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        from vllm.tokenizers import cached_tokenizer_from_config

        model_config = vllm_config.model_config
        protocol = AnswerProtocol.read(model_config.model) or AnswerProtocol()
        tokenizer = cached_tokenizer_from_config(model_config=model_config)

        def ids(text: str) -> tuple[int, ...]:
            return tuple(encode(tokenizer, text))

        answer_format = protocol.format
        self.start_ids = ids(protocol.think_start)
        self.end_ids = ids(answer_format.think_end)
        self.phrase_ids = ids(answer_format.close_phrase)
        self.header_ids = ids(answer_format.header)
        self.summary_max_tokens = answer_format.summary_max_tokens
        self.eos_id = tokenizer.eos_token_id
        self.requests: dict[int, _Tracked] = {}

    def is_argmax_invariant(self) -> bool:
        return False   # it forces tokens

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            if params.thinking_token_budget is not None:
                self.requests[index] = _Tracked(output_ids, self.phrase_start(params.thinking_token_budget, prompt_ids))
            else:
                self.requests.pop(index, None)
        for a, b, direction in batch_update.moved:
            first, second = self.requests.pop(a, None), self.requests.pop(b, None)
            if first is not None:
                self.requests[b] = first
            if second is not None and direction == MoveDirectionality.SWAP:
                self.requests[a] = second

    def phrase_start(self, budget: int, prompt_ids: list[int] | None) -> int:
        """Where vLLM's budget runs out, less the phrase: vLLM counts from the last start marker of the
        prompt (or of the output, when the prompt holds none)."""
        prompt, n = list(prompt_ids or ()), len(self.start_ids)
        starts = [i for i in range(len(prompt) - n + 1) if tuple(prompt[i:i + n]) == self.start_ids]
        after_marker = len(prompt) - (starts[-1] + n) if starts else -n
        return max(0, budget - after_marker - len(self.phrase_ids))

    def forced_token(self, tracked: _Tracked) -> int | None:
        """The token the protocol forces next for this request, or None (the model samples)."""
        out, n = tracked.output, len(self.end_ids)
        if tracked.end_at < 0:
            start = max(0, tracked.scanned - n + 1)
            for i in range(start, len(out) - n + 1):
                if tuple(out[i:i + n]) == self.end_ids:
                    tracked.end_at = i + n
                    break
            tracked.scanned = len(out)
            if tracked.end_at < 0:
                k = len(out) - tracked.phrase_at
                in_phrase = 0 <= k < len(self.phrase_ids) and tuple(out[tracked.phrase_at:]) == self.phrase_ids[:k]
                return self.phrase_ids[k] if in_phrase else None
        after = out[tracked.end_at:]
        h = len(self.header_ids)
        if len(after) < h:
            return self.header_ids[len(after)] if tuple(after) == self.header_ids[:len(after)] else None
        if len(after) - h >= self.summary_max_tokens and self.eos_id is not None:
            return self.eos_id
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, tracked in self.requests.items():
            token = self.forced_token(tracked)
            if token is not None and index < logits.shape[0]:
                logits[index] = float("-inf")
                logits[index, token] = 0.0
        return logits
