"""Post-validation pieces in one process: the Adam/AdamW inverse step, snapshots, and the
speculative step's decisions (the cross-rank rollback runs in test_pipeline_runtime)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from anytime.pipeline.postvalidate import PostValidator, _Snapshot, undo_adam_step

pytestmark = pytest.mark.unit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _backward(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    (scale * model(x).pow(2).sum()).backward()


def _state(opt: torch.optim.Optimizer) -> dict:
    return {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
                                  lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False)])
def test_adam_inverse_undoes_the_last_step(make):
    model = _model()
    opt = make(list(model.parameters()))
    for seed in range(2):
        _backward(model, seed)
        opt.step()
        opt.zero_grad()
    params, state = copy.deepcopy(list(model.parameters())), _state(opt)
    _backward(model, 7)
    opt.step()
    undo_adam_step(opt)
    for p, q in zip(model.parameters(), params):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)
    for p in model.parameters():
        assert float(opt.state[p]["step"]) == float(state[id(p)]["step"]) == 2.0
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][k], state[id(p)][k], rtol=0, atol=1e-14)


def test_undoing_a_first_step_restores_the_fresh_state():
    model = _model()
    before = copy.deepcopy(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _backward(model, 0)
    opt.step()
    undo_adam_step(opt)
    assert len(opt.state) == 0
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


def test_snapshot_restores_any_optimizer_exactly():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _backward(model, 0)
    opt.step()
    params, state = copy.deepcopy(list(model.parameters())), _state(opt)
    snap = _Snapshot(opt)
    _backward(model, 1)
    opt.step()
    snap.restore(opt)
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], state[id(p)]["momentum_buffer"])


def _pair(max_norm):
    ref, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return ref, ref_opt, model, opt, PostValidator(opt, list(model.parameters()), max_grad_norm=max_norm)


def test_speculative_step_is_taken_when_local_gradients_allow_it():
    ref, ref_opt, model, _, val = _pair(max_norm=1e6)
    _backward(ref, 0)
    ref_opt.step()
    _backward(model, 0)
    assert val.step(extras=[2.5]) is None  # result comes from validate()
    v = val.validate()
    assert (v.speculative, v.rolled_back, v.clipped, v.skipped) == (True, False, False, False)
    assert v.extras == [2.5]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None


def test_local_norm_above_threshold_clips_like_torch_and_does_not_speculate():
    ref, ref_opt, model, _, val = _pair(max_norm=0.5)
    _backward(ref, 0, scale=10.0)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    _backward(model, 0, scale=10.0)
    val.step()
    v = val.validate()
    assert (v.speculative, v.rolled_back, v.clipped, v.skipped) == (False, False, True, False)
    assert v.grad_norm == pytest.approx(float(norm), rel=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


def test_non_finite_gradients_skip_the_step():
    _, _, model, opt, val = _pair(max_norm=1.0)
    before = copy.deepcopy(list(model.parameters()))
    _backward(model, 0)
    next(model.parameters()).grad[0, 0] = float("nan")
    val.step()
    v = val.validate()
    assert v.skipped and not v.speculative and v.grad_norm == float("inf")
    assert len(opt.state) == 0
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_blocking_mode_validates_inside_step():
    _, _, model, opt, _ = _pair(max_norm=None)
    val = PostValidator(opt, list(model.parameters()), enabled=False)
    _backward(model, 0)
    v = val.step()
    assert v is not None and not v.speculative and not val.pending
    with pytest.raises(RuntimeError, match="nothing to validate"):
        val.validate()


def test_bad_settings_are_rejected():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="snapshot"):
        PostValidator(sgd, list(model.parameters()), rollback="inverse")
    with pytest.raises(ValueError, match="rollback="):
        PostValidator(sgd, list(model.parameters()), rollback="undo")
    with pytest.raises(ValueError, match="max_grad_norm"):
        PostValidator(sgd, list(model.parameters()), max_grad_norm=0.0)
