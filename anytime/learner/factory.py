"""The learner a recipe names (`learner.backend`, pipelined when `learner.pipeline.stages` > 1),
looked up in `anytime.learner`'s registries and built on this process's device."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from anytime.algo.logprobs import SamplingProcessing
from anytime.defaults import torch_dtype
from anytime.components import LEARNERS, PIPELINE_LEARNERS
from anytime.core.dist import is_main
from anytime.core.precision import Bf16Choice, native_bf16, resolve_bf16
from anytime.learner.base import Learner
from anytime.models.loading import load_model

if TYPE_CHECKING:
    from anytime.config import Recipe

log = logging.getLogger(__name__)


def learner_class(pipelined: bool, backend: str) -> type:
    return (PIPELINE_LEARNERS if pipelined else LEARNERS).get(backend)


def sampling_processing(recipe: Recipe) -> SamplingProcessing | None:
    """What the learner applies to its logits so its log-probs are the engine's (`rollout.logprobs`):
    the rollout's temperature and top-p (processed), or nothing (raw)."""
    if recipe.rollout.logprobs == "raw":
        return None
    r = recipe.rollout
    return SamplingProcessing(r.temperature, r.top_p, recipe.summary.temperature, r.top_p)


def learner_device() -> torch.device:
    """This process's learner device: its GPU (`cuda:LOCAL_RANK`, the one `init_from_env` selects) when
    CUDA is available, else the CPU. The supervised warm start trains there too."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def learner_precision(recipe: Recipe, device_type: str) -> Bf16Choice:
    """`learner.bf16` on `device_type`, said in one line by rank 0 (`resolve_bf16`: a RecipeError for
    an explicit true on a CPU without a native bf16 GEMM). The learners resolve `auto` alike."""
    choice = resolve_bf16(recipe.learner.bf16, device_type, native_bf16(device_type))
    if is_main():
        log.log(logging.DEBUG if choice.requested is False else logging.INFO, "%s", choice.reason)
    return choice


def build_learner(recipe: Recipe, model_path: str) -> Learner:
    """The learner a recipe asks for, on this process's device. Pipelined learners build their
    stages from the model path; the data-parallel ones take a loaded model (and the reference
    model, when the KL term needs one)."""
    learner = _build(recipe, model_path)
    processing = sampling_processing(recipe)
    if processing is not None:   # the recipe check refuses it for pipelined learners
        learner.processing = processing   # type: ignore[attr-defined]
    return learner


def _build(recipe: Recipe, model_path: str) -> Learner:
    lc = recipe.learner
    device = learner_device().type   # "cuda" is the current device: this rank's own
    learner_precision(recipe, device)
    dtype = torch_dtype(recipe.model.dtype)
    total = recipe.trainer.steps
    pipelined = lc.pipeline.stages > 1
    kind = learner_class(pipelined, lc.backend)
    if pipelined:
        return kind(model_path, lc, total, dtype=dtype, seed=recipe.trainer.seed, device=device)
    model = load_model(model_path, dtype, device, recipe.model.trust_remote_code, recipe.model.gradient_checkpointing)
    if lc.lora.rank > 0:  # the reference model is this model with the adapter switched off
        from anytime.learner.freeze import top_layer_indices
        from anytime.learner.lora import apply_lora

        layers = top_layer_indices(model, lc.trainable_layers) if lc.trainable_layers else None
        return kind(model, lc, total, peft_model=apply_lora(model, lc.lora, model_path, layers=layers))
    if lc.trainable_layers:
        from anytime.learner.freeze import train_top_layers

        train_top_layers(model, lc.trainable_layers)
    ref = None
    if lc.reference_model:
        ref = load_model(model_path, dtype, device, recipe.model.trust_remote_code, False).eval()
        ref.requires_grad_(False)
    return kind(model, lc, total, ref_model=ref)
