"""Checkpoints: the model as a Hugging Face folder (safetensors), the learner's own state, RNG
states, data position and step. Everything is written into `step_N.tmp/` and renamed to `step_N/`
only when complete, so a kill at any moment leaves the last complete checkpoint intact; the last K
are kept.

Nothing is unpickled with code execution on load: weights are safetensors, our own `.pt` files are
read with `torch.load(weights_only=True)`, and DeepSpeed's shards (which DeepSpeed unpickles itself)
are first checked with the same weights-only reader, allowing only DeepSpeed's plain data classes.
A checkpoint folder from an untrusted source therefore cannot run code in the trainer.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anytime.core.dist import barrier, is_main, rank_world

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pt"
MASTER_WEIGHTS = "master_weights.safetensors"   # float32 masters of a bf16 / fp16 torch learner


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()[1].tolist(), "numpy_pos": int(np.random.get_state()[2])}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))


def load_tensors(path: Path) -> Any:
    """A `.pt` file of tensors and plain Python values; anything else (code) is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {path} is missing; the checkpoint is incomplete or was written "
                                "by another learner layout") from None
    except Exception as exc:  # weights-only unpickling refused something
        raise ValueError(f"refusing to load {path}: it holds more than tensors and plain values ({exc})") from None


def _deepspeed_safe_globals() -> list[Any]:
    """DeepSpeed's plain data classes that its optimizer shards pickle (no code runs when they are
    rebuilt): the loss scaler, ZeRO's enum and fragment addresses."""
    import deepspeed.runtime.fp16.loss_scaler as loss_scaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [loss_scaler.LossScaler, loss_scaler.DynamicLossScaler, ZeroStageEnum, fragment_address]


def check_deepspeed_files(folder: Path) -> None:
    """Refuse a DeepSpeed checkpoint folder any of whose files would run code when unpickled."""
    files = sorted(folder.glob("*.pt"))
    if not files:
        raise FileNotFoundError(f"no DeepSpeed checkpoint files in {folder}")
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for f in files:
            load_tensors(f)


def read_model_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The full model's weights saved in a checkpoint's `model/` folder."""
    from safetensors.torch import load_file

    files = sorted((folder / "model").glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {folder} has no model/*.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    missing, unexpected = model.load_state_dict(read_model_weights(folder), strict=False)
    tied = {k for k in missing if "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}")


def save_master_weights(masters: dict[str, torch.Tensor], folder: Path) -> None:
    """A learner's float32 master weights (of a bf16 / fp16 model), by parameter name: the model
    folder holds only their rounding, and a resume must continue from the masters."""
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous() for name, t in masters.items()}, folder / MASTER_WEIGHTS)


@torch.no_grad()
def load_master_weights(masters: dict[str, torch.Tensor], folder: Path) -> None:
    """Copy a checkpoint's master weights into a live learner's `masters` (over the rounded weights
    its model folder gave them); a checkpoint without them leaves those, with a warning."""
    from safetensors.torch import load_file

    path = folder / MASTER_WEIGHTS
    if not path.is_file():
        log.warning("checkpoint %s has no %s: its weights resume from the model folder's rounding", folder,
                    MASTER_WEIGHTS)
        return
    saved = load_file(path)
    if saved.keys() != masters.keys():
        missing, unexpected = sorted(masters.keys() - saved.keys()), sorted(saved.keys() - masters.keys())
        raise ValueError(f"checkpoint {path} does not match the learner's trainable weights: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    for name, weight in masters.items():
        weight.copy_(saved[name])


def save_hf_folder(config: Any, state: dict[str, torch.Tensor], folder: Path, tokenizer: Any = None,
                   generation_source: str | None = None) -> None:
    """A Hugging Face model folder from a full state dict, through a weightless (meta) model of the
    config, so no learner needs its whole model in one process to write it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if generation_source is not None:  # keep the model's generation settings (eos ids)
        try:
            skeleton.generation_config = GenerationConfig.from_pretrained(generation_source)
        except OSError:
            pass
    skeleton.save_pretrained(folder, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of interrupted writes are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))
             and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def in_flight_file(folder: Path, rank: int) -> Path:
    """A rank's rollouts in flight at the checkpoint (`rollout.max_staleness` > 0), generated with
    earlier weights than the checkpoint's and needed to continue exactly."""
    return folder / f"in_flight_rank{rank}.pt"


def load_in_flight(folder: Path, rank: int) -> list[dict[str, Any]] | None:
    """This rank's in-flight rollouts of a checkpoint, or None if it was saved without any."""
    path = in_flight_file(folder, rank)
    return load_tensors(path) if path.is_file() else None


def save_checkpoint(root: str | Path, step: int, learner: Any, tokenizer: Any, trainer_state: dict[str, Any],
                    keep_last: int, generation_source: str | None = None,
                    in_flight: list[dict[str, Any]] | None = None) -> Path:
    """Collective: every learner rank calls it; `in_flight` is this rank's rollouts in flight (tensors
    and plain values), committed with the rest."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    # a LoRA learner writes only its adapter (`adapter/`, in `save`): no full weights to gather
    adapter = getattr(learner, "peft_model", None) is not None
    state = None if adapter else learner.full_state_dict()
    learner.save(tmp)
    if in_flight:
        torch.save(in_flight, in_flight_file(tmp, rank_world()[0]))
    barrier()
    if is_main():
        if state is not None:
            save_hf_folder(learner.config, state, tmp / "model", tokenizer, generation_source)
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp / "adapter")
        torch.save(rng_state(), tmp / RNG_STATE)
        (tmp / TRAINER_STATE).write_text(json.dumps(dict(trainer_state, step=step), indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # the atomic commit point
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def resolve_resume(root: str | Path, resume: str) -> Path | None:
    """`auto`: the newest complete checkpoint under root (or None); `never`; or an explicit folder."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"trainer.resume: {resume!r} is not a complete checkpoint folder "
                                f"(no {TRAINER_STATE}); use auto, never, or a step_N folder")
    return path


def load_checkpoint(path: Path, learner: Any) -> dict[str, Any]:
    """Load weights, learner state and RNG into a live learner (collective); returns the trainer state."""
    learner.load(path)
    set_rng_state(load_tensors(path / RNG_STATE))
    log.info("resumed from %s", path)
    return json.loads((path / TRAINER_STATE).read_text())
