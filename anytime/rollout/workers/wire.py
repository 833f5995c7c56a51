"""The wire format between a rollout worker in a process of its own and learner rank 0: tensors as numpy
arrays with their dtype names (plain pickles, no shared-memory tensor handles to outlive a process;
bfloat16 travels as its bits), alone or inside the plain data of a `ScoredRollout.to_state()`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anytime.batch.anytime_rollout import ScoredRollout


def _array_of(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A tensor as a numpy array and its dtype name (bfloat16 travels as its bits)."""
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return raw.numpy(), str(t.dtype).removeprefix("torch.")


def _tensor_of(array: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(array))  # a copy: object-store arrays are read-only
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def to_numpy(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Tensors as numpy arrays with their dtype names, to send to or from a worker process (plain
    pickles: no shared-memory tensor handles to outlive a process)."""
    return {name: _array_of(t) for name, t in state.items()}


def from_numpy(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    return {name: _tensor_of(a, dtype) for name, (a, dtype) in arrays.items()}


def to_numpy_tree(value: Any) -> Any:
    """`value` (dicts, lists and plain values around tensors) with every tensor as numpy, as
    `to_numpy` sends it, to send a `ScoredRollout.to_state()` from a worker process;
    `from_numpy_tree` inverts it."""
    if isinstance(value, torch.Tensor):
        return _NumpyTensor(*_array_of(value))
    if isinstance(value, dict):
        return {k: to_numpy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_numpy_tree(v) for v in value]
    return value


def from_numpy_tree(value: Any) -> Any:
    if isinstance(value, _NumpyTensor):
        return _tensor_of(value.array, value.dtype)
    if isinstance(value, dict):
        return {k: from_numpy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_numpy_tree(v) for v in value]
    return value


@dataclass
class _NumpyTensor:
    array: np.ndarray
    dtype: str


def scored_from_worker(sent: Any) -> ScoredRollout:
    """A worker process's `to_numpy_tree(scored.to_state())` back as a `ScoredRollout`."""
    return ScoredRollout.from_state(from_numpy_tree(sent))
