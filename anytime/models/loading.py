"""Loading a causal LM for the learners, and the check that its log-probs come from the LM head
alone (the learners compute them from decoder states, in chunks)."""

from __future__ import annotations

import torch


def load_model(path: str, dtype: torch.dtype, device: str, trust_remote_code: bool = False,
               gradient_checkpointing: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code).to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def check_plain_head(model: torch.nn.Module) -> None:
    """Log-probs are taken from decoder states through the output embedding: refuse models whose
    forward transforms logits further (they would silently train on other log-probs)."""
    config = model.config
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(f"{type(model).__name__} scales or caps its logits ({name}={getattr(config, name)}); "
                             f"the learner computes log-probs from the LM head alone and does not support it")
