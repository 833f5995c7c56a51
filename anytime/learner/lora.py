"""Low-rank adapters (`learner.lora`) through peft, for the data-parallel learners.

peft injects its LoRA layers into the loaded Hugging Face model in place, so the learners keep
working on that model (its decoder and LM head, `forward_logprobs`) and hold the `PeftModel` only
to switch the adapter off (the KL reference is the base model, no second copy) and to save it.
Only the adapter's parameters train, so the optimizer state, the checkpoint (`adapter/`, a PEFT
folder) and the weight sync to a transformers engine are adapter-sized. Engines that take full
weights (vLLM, Ray actors) get the merged weights (`merged_state_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from anytime.config import LoRAConfig

ADAPTER_DIR = "adapter"     # a checkpoint's PEFT adapter folder
ADAPTER = "default"         # peft's name of the one adapter

# (Hugging Face weight name, lora_A [r, in], lora_B [out, r], scaling): the engine's weight becomes
# base + (B @ A) * scaling, the arithmetic of peft's `get_delta_weight`.
AdapterUpdate = list[tuple[str, torch.Tensor, torch.Tensor, float]]


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, base_path: str, layers: list[int] | None = None) -> Any:
    """Inject trainable LoRA layers into `model` (in place) and freeze everything else; returns the
    `PeftModel` around it. `layers`: the decoder layers adapted (None: all). `base_path` is recorded
    in the adapter's config (absolute when local)."""
    from peft import LoraConfig, get_peft_model

    path = Path(base_path)
    where = {} if layers is None else {"layers_to_transform": layers, "layers_pattern": "layers"}
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM", **where)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # e.g. target modules the model does not have
        from anytime.errors import RecipeError

        raise RecipeError(f"`learner.lora.target_modules` {cfg.target_modules}: {exc}") from None
    peft_model.peft_config[ADAPTER].base_model_name_or_path = str(path.resolve()) if path.exists() else base_path
    if getattr(model, "is_gradient_checkpointing", False):  # frozen embeddings: checkpointed blocks need an input grad
        model.enable_input_require_grads()
    return peft_model


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]


def hf_name(module_name: str) -> str:
    """`base_model.model.model.layers.0.q_proj` (or without peft's prefix) → `model.layers.0.q_proj.weight`."""
    return module_name.removeprefix("base_model.model.") + ".weight"


def adapter_update(model: torch.nn.Module) -> AdapterUpdate:
    """The adapter's factors per adapted weight (see `AdapterUpdate`), detached."""
    return [(hf_name(name), m.lora_A[ADAPTER].weight.detach(), m.lora_B[ADAPTER].weight.detach(),
             float(m.scaling[ADAPTER])) for name, m in lora_layers(model)]


def merge_delta(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """base + (B @ A) * scaling in base's dtype (peft's merge for a plain linear layer)."""
    return base + ((b.to(base.dtype) @ a.to(base.dtype)) * scaling)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names with the adapter merged in (for engines that
    take full weights, and for export)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_" not in key:
            out[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = value.detach()
    for name, a, b, scaling in adapter_update(model):
        out[name] = merge_delta(out[name], a, b, scaling)
    return out


def adapter_bytes(update: AdapterUpdate) -> int:
    return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b, _ in update)


def save_adapter(peft_model: Any, folder: Path) -> None:
    """The PEFT adapter folder (adapter_config.json + adapter_model.safetensors) under folder/adapter."""
    peft_model.save_pretrained(folder / ADAPTER_DIR, safe_serialization=True)


def load_adapter(peft_model: Any, folder: Path) -> None:
    """Restore the adapter a checkpoint's `adapter/` holds into a live `PeftModel`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = folder / ADAPTER_DIR / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {ADAPTER_DIR}/adapter_model.safetensors; it was not "
                                "written by a LoRA learner (learner.lora.rank > 0)")
    result = set_peft_model_state_dict(peft_model, load_file(file))
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {folder}'s adapter does not match learner.lora: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")
