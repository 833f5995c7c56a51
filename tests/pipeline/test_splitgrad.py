"""SplitLinear: I computes input gradients only, W adds the exact weight gradients later."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anytime.pipeline.splitgrad import SplitLinear, WeightGradStore, convert_linears

pytestmark = pytest.mark.unit


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5, bias=False)).double()


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_split_backward_equals_fused_backward():
    ref = _mlp()
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    ref(x).pow(2).sum().backward()
    want_x, want = x.grad.clone(), _grads(ref)

    model, store = _mlp(), WeightGradStore()
    assert convert_linears(model, store) == 2
    x.grad = None
    with store.recording(("s", 0)):
        out = model(x)
    with store.deferring():
        out.pow(2).sum().backward()
    # I: input gradient exact, linear weights untouched until W.
    assert torch.equal(x.grad, want_x)
    assert all(p.grad is None for p in model.parameters())
    assert store.pending(("s", 0))
    assert store.flush(("s", 0)) == 2
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=1e-14)
        assert p.grad.grad_fn is None


def test_fused_mode_computes_weight_grads_inline():
    ref, model, store = _mlp(), _mlp(), WeightGradStore()
    convert_linears(model, store)
    x = torch.randn(5, 6, dtype=torch.float64)
    ref(x).sum().backward()
    with store.recording(0):
        model(x).sum().backward()
    assert store.keys() == []
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, _grads(ref)[n], rtol=0, atol=1e-14)


def test_weight_grads_are_keyed_by_microbatch_and_accumulate_in_any_order():
    ref, model, store = _mlp(), _mlp(), WeightGradStore()
    convert_linears(model, store)
    xs = [torch.randn(2, 6, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        ref(x).sum().backward()
    outs = []
    for j, x in enumerate(xs):
        with store.recording(j):
            outs.append(model(x).sum())
    for out in outs:
        with store.deferring():
            out.backward()
    assert sorted(store.keys()) == [0, 1, 2]
    for j in (2, 0, 1):
        store.flush(j)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, _grads(ref)[n], rtol=0, atol=1e-13)


def test_pending_bytes_count_shared_inputs_once():
    store = WeightGradStore()
    q, k = (SplitLinear(nn.Linear(16, 16, bias=False), store) for _ in range(2))
    x = torch.randn(4, 16, requires_grad=True)
    with store.recording("mb"):
        out = q(x) + k(x)
    with store.deferring():
        out.backward(torch.randn_like(out))
    # one shared input (4x16) + two grad-outputs (the same tensor, passed through the add): fp32 bytes
    assert store.pending_bytes("mb") == x.numel() * 4 + out.numel() * 4
    store.flush("mb")
    assert store.pending_bytes() == 0


def test_conversion_keeps_parameters_names_and_outputs():
    model = _mlp()
    before = {n: p for n, p in model.named_parameters()}
    x = torch.randn(3, 6, dtype=torch.float64)
    want = model(x)
    convert_linears(model, WeightGradStore())
    assert {n: p for n, p in model.named_parameters()} == before
    assert isinstance(model[0], SplitLinear)
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_deferring_without_a_recorded_key_is_an_error():
    store = WeightGradStore()
    layer = SplitLinear(nn.Linear(3, 3), store)
    out = layer(torch.randn(2, 3)).sum()
    with store.deferring(), pytest.raises(RuntimeError, match="recording"):
        out.backward()
