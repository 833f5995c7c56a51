"""Train only the top of the model (`learner.trainable_layers`): the top N decoder layers (and the
final norm, and an untied LM head) train, everything below is frozen.

Why: on a small budget the update dominates a step, and most of an update is the backward. With
every parameter below the lowest trainable layer frozen (embeddings included), autograd records
nothing there: no backward runs below that layer and none of its activations are kept, so the
update's cost falls roughly with the share of layers that train. With LoRA the same knob puts
adapters on the top N layers only (peft's `layers_to_transform`).
"""

from __future__ import annotations

import torch

from anytime.errors import RecipeError


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (`model.get_decoder().layers` in transformers)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise RecipeError(f"`learner.trainable_layers` needs a decoder with a `layers` list; "
                          f"{type(model).__name__} has none: set learner.trainable_layers=0")
    return layers


def top_layer_indices(model: torch.nn.Module, count: int) -> list[int]:
    """Indices of the top `count` decoder layers; an error when the model has fewer."""
    total = len(decoder_layers(model))
    if not 0 < count <= total:
        raise RecipeError(f"`learner.trainable_layers` is {count} but the model has {total} decoder layers: "
                          f"choose 1..{total}, or 0 for all")
    return list(range(total - count, total))


def train_top_layers(model: torch.nn.Module, count: int) -> list[int]:
    """Freeze `model` except its top `count` decoder layers, the decoder's final norm and the LM
    head when it is not tied to the (frozen) input embeddings; returns the trained layers' indices."""
    indices = top_layer_indices(model, count)
    layers = decoder_layers(model)
    model.requires_grad_(False)
    for i in indices:
        layers[i].requires_grad_(True)
    norm = getattr(model.get_decoder(), "norm", None)
    if isinstance(norm, torch.nn.Module):
        norm.requires_grad_(True)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and (embed is None or head.weight is not embed.weight):
        head.requires_grad_(True)
    if getattr(model, "is_gradient_checkpointing", False):  # checkpointed blocks need an input that needs grad
        model.enable_input_require_grads()
    return indices
