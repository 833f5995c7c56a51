"""Split backward for linear layers: input gradients now (I), weight gradients later (W).

Zero-bubble schedules fill pipeline bubbles with the weight-gradient half of the backward.
PyTorch's own split (`torch.distributed.pipelining`) runs a second `autograd.grad` over the
graph, which redoes work (~15% here). Instead, `SplitLinear` runs a custom autograd function
whose backward computes only `grad_input = grad_out @ W` and queues `(input, grad_out)` in a
`WeightGradStore`, keyed by (stage, microbatch); a W action then runs the queued weight GEMMs
straight into `.grad`. I + W therefore does the same GEMMs as the fused backward. Only linear
weights (and their biases) are deferred; norm and embedding gradients stay in I, as in the
zero-bubble reference code.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class _PendingGrad:
    """One deferred weight-gradient GEMM: dW += g^T x (and db += Σ g)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    inputs: torch.Tensor
    grad_out: torch.Tensor


def _storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of memory behind `tensors`: per storage, the range its views cover (views of one
    buffer count once; a row slice of a larger caller buffer counts only its rows)."""
    spans: dict[int, tuple[int, int]] = {}
    for t in tensors:
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = (t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size
        ptr = t.untyped_storage().data_ptr()
        old = spans.get(ptr, (lo, hi))
        spans[ptr] = (min(old[0], lo), max(old[1], hi))
    return sum(hi - lo for lo, hi in spans.values())


class WeightGradStore:
    """Queue of deferred weight-gradient work, one bucket per key (e.g. (stage, microbatch)).

    The forward records which key the next activations belong to (`recording`); backward
    passes inside `deferring()` queue their weight GEMMs under that key instead of running
    them; `flush(key)` runs them. Keying by microbatch (not "latest") keeps W exact whatever
    order the schedule runs the W's in.
    """

    def __init__(self) -> None:
        self._buckets: dict[Hashable, list[_PendingGrad]] = {}
        self.key: Hashable | None = None
        self.defer = False

    @contextmanager
    def recording(self, key: Hashable) -> Iterator[None]:
        """Tag the linear layers run inside the block as belonging to `key`."""
        previous, self.key = self.key, key
        try:
            yield
        finally:
            self.key = previous

    @contextmanager
    def deferring(self, enabled: bool = True) -> Iterator[None]:
        """Backward passes run inside the block queue their weight GEMMs (I) instead of running them (B)."""
        previous, self.defer = self.defer, enabled
        try:
            yield
        finally:
            self.defer = previous

    def push(self, key: Hashable, item: _PendingGrad) -> None:
        self._buckets.setdefault(key, []).append(item)

    def pending(self, key: Hashable) -> bool:
        return key in self._buckets

    def keys(self) -> list[Hashable]:
        return list(self._buckets)

    def pending_bytes(self, key: Hashable | None = None) -> int:
        """Bytes kept alive by queued inputs/grad-outputs (the M_W of the memory model)."""
        buckets = self._buckets.values() if key is None else [self._buckets.get(key, [])]
        return _storage_bytes(t for items in buckets for it in items for t in (it.inputs, it.grad_out))

    def flush(self, key: Hashable) -> int:
        """Run the queued weight GEMMs of `key` into `.grad`; returns how many layers were done."""
        items = self._buckets.pop(key, [])
        with torch.no_grad():
            for it in items:
                _accumulate_weight_grad(it)
        return len(items)

    def clear(self) -> None:
        self._buckets.clear()


def _accumulate_weight_grad(item: _PendingGrad) -> None:
    out_features, in_features = item.weight.shape
    g = item.grad_out.reshape(-1, out_features)
    x = item.inputs.reshape(-1, in_features)
    w = item.weight
    # addmm_ into the existing gradient avoids a temporary the size of W.
    if w.grad is None:
        w.grad = torch.mm(g.t(), x)
    else:
        w.grad.addmm_(g.t(), x)
    if item.bias is not None:
        b = item.bias
        if b.grad is None:
            b.grad = g.sum(0)
        else:
            b.grad.add_(g.sum(0))


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore, key: Hashable) -> torch.Tensor:
        # The parameters go on ctx, not through save_for_backward: saved-tensor hooks (offload)
        # would hand back a new tensor object, and W must accumulate into the Parameter's .grad.
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store, ctx.key = weight, bias, store, key
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        wants_w = ctx.needs_input_grad[1] or (ctx.bias is not None and ctx.needs_input_grad[2])
        if not wants_w:
            return grad_in, None, None, None, None
        store: WeightGradStore = ctx.store
        if store.defer:
            if ctx.key is None:
                raise RuntimeError("SplitLinear ran forward outside WeightGradStore.recording(); "
                                   "cannot key its deferred weight gradient")
            store.push(ctx.key, _PendingGrad(weight, ctx.bias, x, grad_out))
            return grad_in, None, None, None, None
        g = grad_out.reshape(-1, weight.shape[0])
        grad_w = torch.mm(g.t(), x.reshape(-1, weight.shape[1])) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.bias is not None and ctx.needs_input_grad[2] else None
        return grad_in, grad_w, grad_b, None, None


class SplitLinear(nn.Module):
    """Drop-in for `nn.Linear` (same Parameter objects, same state-dict keys) whose weight
    gradient can be deferred through a `WeightGradStore`."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return _SplitLinearFn.apply(x, self.weight, self.bias, self.store, self.store.key)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def convert_linears(module: nn.Module, store: WeightGradStore) -> int:
    """Replace every `nn.Linear` inside `module` by a `SplitLinear` sharing its parameters.

    Returns the number of layers converted. The module's parameters, state-dict keys and
    forward results are unchanged; only where weight gradients are computed changes.
    """
    targets = [(parent, name, child) for parent in module.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, SplitLinear(child, store))
    return len(targets)
