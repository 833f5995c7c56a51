"""Saved-activation accounting and offload: same gradients, bytes moved once, originals freed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from anytime.pipeline.offload import SavedActivations

pytestmark = pytest.mark.unit


class _Block(nn.Module):
    """Saves views (transposes) of one buffer and a few separate intermediates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        scores = h @ h.transpose(-1, -2)      # saves h and h^T: one storage
        return self.b(torch.softmax(scores, -1) @ h)


def _run(device: str, offload: bool, prefetch: bool = False):
    block = _Block().double().to(device)
    saved = SavedActivations(device, block.parameters())
    x = torch.randn(4, 40, 32, dtype=torch.float64, device=device, requires_grad=True)
    with saved.forward("k", offload=offload):
        out = block(x)
    after_forward = saved.device_bytes("k")
    if prefetch:
        saved.prefetch("k")
    out.pow(2).sum().backward()
    saved.release("k")
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return grads, after_forward, saved


def test_offload_keeps_gradients_and_moves_each_storage_once():
    want, resident, plain = _run("cpu", offload=False)
    got, offloaded_resident, saved = _run("cpu", offload=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    stats = saved.stats
    assert plain.stats.offloaded == 0 and resident > 0
    assert stats.offloaded > 0 and stats.offloaded == stats.reloaded == stats.freed == stats.peak_host
    # Only storages at or below the size threshold (and the caller-held input) stay resident.
    assert offloaded_resident + stats.offloaded == resident
    assert saved.keys() == [] and saved.host_bytes() == 0


def test_prefetch_reloads_before_backward():
    got, _, saved = _run("cpu", offload=True, prefetch=True)
    want, _, _ = _run("cpu", offload=False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert saved.stats.reloaded == saved.stats.offloaded > 0


def test_views_of_one_buffer_are_copied_once_and_originals_are_freed():
    saved = SavedActivations("cpu")
    x = torch.randn(64, 48, dtype=torch.float64, requires_grad=True)
    with saved.forward("v", offload=True):
        h = torch.sin(x)                            # sin saves x (caller-held input: also offloaded)
        y = (h @ h.t()).sum()                       # mm saves h and h.t(): one storage
    ref = StorageWeakRef(h.untyped_storage())
    del h
    assert ref.expired(), "the device copy of an offloaded activation must be released after F"
    assert saved.stats.offloaded == 2 * x.numel() * 8  # x once, h once (not twice for h.t())
    y.backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(x) * (torch.sin(x).sum(0, keepdim=True) * 1.0)
                               .expand_as(x), rtol=1e-12, atol=1e-12)


def test_accounting_without_offload_counts_distinct_storages():
    saved = SavedActivations("cpu")
    x = torch.randn(1025, dtype=torch.float64, requires_grad=True)
    with saved.forward(0):
        y = (x.exp() * x.exp()).sum()               # exp saves its output; mul saves both operands
    assert saved.device_bytes(0) == 8 * x.numel() * 2  # the two exp(x) buffers, each counted once
    y.backward()
    saved.release(0)
    assert saved.device_bytes() == 0
    with pytest.raises(RuntimeError, match="twice"):
        with saved.forward(1):
            pass
        with saved.forward(1):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_frees_device_memory_and_matches():
    want, _, _ = _run("cuda", offload=False)
    torch.cuda.synchronize()
    block = _Block().double().cuda()
    saved = SavedActivations("cuda", block.parameters())
    x = torch.randn(4, 40, 32, dtype=torch.float64, device="cuda", requires_grad=True)
    base = torch.cuda.memory_allocated()
    with saved.forward("k", offload=True):
        out = block(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    assert held < saved.stats.offloaded  # the offloaded activations left the GPU
    saved.prefetch("k")
    out.pow(2).sum().backward()
    for a, b in zip([x.grad] + [p.grad for p in block.parameters()], want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_row_slice_of_a_caller_batch_counts_and_moves_only_its_rows():
    batch = torch.randn(8, 256, dtype=torch.float64)
    w = torch.randn(256, 4, dtype=torch.float64, requires_grad=True)
    for offload in (False, True):
        saved = SavedActivations("cpu")
        with saved.forward("mb", offload=offload):
            y = (batch[2:4] @ w).sum()              # mm saves the slice for dW
        rows_bytes = 2 * 256 * 8
        assert saved.device_bytes("mb") == (0 if offload else rows_bytes)
        assert saved.stats.offloaded == (rows_bytes if offload else 0)
        y.backward()
        torch.testing.assert_close(w.grad, batch[2:4].sum(0)[:, None].expand(256, 4), rtol=0, atol=1e-12)
        w.grad = None
