"""Checkpoints: model (safetensors, Hugging Face layout), optimizer/scheduler, RNG states, data
position and step. Each is written into `step_N.tmp/` and renamed to `step_N/` only when complete,
so a kill at any moment leaves the last complete checkpoint intact; the last K are kept."""

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
import torch.distributed as dist

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.json"


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()[1].tolist(), "numpy_pos": int(np.random.get_state()[2])}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of interrupted writes are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))
             and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def save_checkpoint(root: str | Path, step: int, model: Any, tokenizer: Any, backend: Any,
                    trainer_state: dict[str, Any], keep_last: int) -> Path:
    root = Path(root)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if _is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state = backend.full_state_dict()
    engine = getattr(backend, "engine", None)
    if engine is not None:  # DeepSpeed: optimizer shards from every rank
        engine.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)
    if _is_main():
        model.save_pretrained(tmp / "model", state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save({"backend": backend.state_dict(), "rng": rng_state()}, tmp / "learner_state.pt")
        (tmp / TRAINER_STATE).write_text(json.dumps(dict(trainer_state, step=step), indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # the atomic commit point
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
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


def load_checkpoint(path: Path, backend: Any) -> dict[str, Any]:
    """Load weights + optimizer + RNG into a live backend; returns the trainer state."""
    from safetensors.torch import load_file

    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.load_checkpoint(str(path), tag="deepspeed", load_module_strict=False)
    else:
        files = sorted((path / "model").glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        missing, unexpected = backend.model.load_state_dict(state, strict=False)
        tied = {k for k in missing if "lm_head" in k}
        if set(missing) - tied or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    blob = torch.load(path / "learner_state.pt", weights_only=False, map_location="cpu")
    backend.load_state_dict(blob["backend"])
    set_rng_state(blob["rng"])
    log.info("resumed from %s", path)
    return json.loads((path / TRAINER_STATE).read_text())
