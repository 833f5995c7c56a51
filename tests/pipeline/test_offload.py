"""Saved-activation accounting and offload: same gradients, bytes moved once, originals freed,
and the asynchronous copies ordered (checked on the CPU with fake streams, and on CUDA)."""

from __future__ import annotations

from contextlib import contextmanager
from itertools import count

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from anytime.pipeline.offload import SavedActivations


class _Block(nn.Module):
    """Saves views (transposes) of one buffer and a few separate intermediates."""

    def __init__(self, width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(width, hidden)
        self.b = nn.Linear(hidden, width)

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


@pytest.mark.unit
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


@pytest.mark.unit
def test_prefetch_reloads_before_backward():
    got, _, saved = _run("cpu", offload=True, prefetch=True)
    want, _, _ = _run("cpu", offload=False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert saved.stats.reloaded == saved.stats.offloaded > 0


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.gpu
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


@pytest.mark.unit
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


# -- ordering of the asynchronous copies ----------------------------------------------------------
class _FakeStream:
    def __init__(self, streams: _FakeStreams, name: str) -> None:
        self.streams, self.name = streams, name

    def wait_stream(self, other: _FakeStream) -> None:
        self.streams.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _FakeEvent) -> None:
        self.streams.log.append(("wait_event", self.name, event.name))


class _FakeEvent:
    def __init__(self, streams: _FakeStreams, name: str) -> None:
        self.streams, self.name = streams, name

    def record(self, stream: _FakeStream) -> None:
        self.streams.log.append(("record", stream.name, self.name))


class _FakeStreams(TorchDispatchMode):
    """Stands in for `torch.cuda` on the CPU and logs, in order, each wait and event record, and
    (as a dispatch mode, which also sees the unpack hooks the backward runs) each copy and each
    view set on a storage, with the stream that was current then."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []
        self._names = count()
        self.compute = _FakeStream(self, "compute")
        self._current = self.compute

    def Stream(self, device) -> _FakeStream:  # noqa: N802 - mirrors torch.cuda
        return _FakeStream(self, f"side{next(self._names)}")

    def Event(self) -> _FakeEvent:  # noqa: N802 - mirrors torch.cuda
        return _FakeEvent(self, f"event{next(self._names)}")

    def current_stream(self, device) -> _FakeStream:
        return self._current

    @contextmanager
    def stream(self, stream: _FakeStream):
        outer, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.log.append(("copy", self._current.name, args[0].data_ptr(), args[1].data_ptr()))
        elif func in (torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset):
            self.log.append(("view", self._current.name, args[1].data_ptr()))
        return func(*args, **(kwargs or {}))


def _first(log: list[tuple], start: int, *head) -> int:
    """Index of the first entry from `start` on that begins with `head` (len(log) if none)."""
    return next((i for i in range(start, len(log)) if log[i][:len(head)] == head), len(log))


@pytest.mark.unit
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetched", "reloaded-on-use"])
def test_reload_waits_for_its_offload_copy_and_compute_waits_for_the_reload(prefetch: bool):
    streams = _FakeStreams()
    saved = SavedActivations("cpu", streams=streams)
    x = torch.randn(64, 48, dtype=torch.float64, requires_grad=True)
    with streams:
        with saved.forward("k", offload=True):
            h = torch.sin(x)
            y = (h @ h.t()).sum()
        if prefetch:
            saved.prefetch("k")
        y.backward()
    log = streams.log
    copies = [i for i, e in enumerate(log) if e[0] == "copy"]
    offload_copy_of = {log[i][2]: i for i in copies}       # host buffer -> the copy that filled it
    reloads = [i for i in copies if log[i][3] in offload_copy_of]
    assert len(reloads) == 2, f"x and h must each be copied back once: {log}"
    for reload in reloads:
        _, h2d, device_buffer, host_buffer = log[reload]
        offload = offload_copy_of[host_buffer]
        d2h = log[offload][1]
        assert d2h not in ("compute", h2d)
        assert ("wait_stream", d2h, "compute") in log[:offload], "D2H copy started before the forward ended"
        offloaded = log[_first(log, offload, "record", d2h)][2]
        assert ("wait_event", h2d, offloaded) in log[:reload], (
            f"H2D copy on {h2d} reads the host buffer without waiting for the D2H copy ({offloaded})")
        reloaded = log[_first(log, reload, "record", h2d)][2]
        first_use = _first(log, reload, "view", "compute", device_buffer)
        assert ("wait_event", "compute", reloaded) in log[reload:first_use], (
            f"the compute stream reads the reloaded buffer before its H2D copy ({reloaded}) is done")
    torch.testing.assert_close(x.grad, 2 * torch.cos(x) * torch.sin(x).sum(0, keepdim=True).expand_as(x),
                               rtol=1e-12, atol=1e-12)


def _pipeline(device: str, offload: bool, width: int, length: int, microbatches: int = 4):
    """Two stages, cut at their boundary like the executor does; every forward first, then the
    backwards in reverse, each reload started one action ahead of its backward (as the executor's
    prefetch does) and the first right after the last forward, with no synchronisation."""
    stages = [_Block(width, 2 * width).double().to(device) for _ in range(2)]
    params = [p for stage in stages for p in stage.parameters()]
    saved = SavedActivations(device, params)
    g = torch.Generator().manual_seed(1)
    roots, stage_inputs, losses = {}, {}, []
    for mb in range(microbatches):
        h = torch.randn(4, length, width, generator=g, dtype=torch.float64).to(device)
        for s, stage in enumerate(stages):
            if s > 0:
                h = stage_inputs[(s, mb)] = h.detach().requires_grad_()
            with saved.forward((s, mb), offload=offload):
                h = roots[(s, mb)] = stage(h)
        losses.append(h.pow(2).mean())
        roots[(len(stages) - 1, mb)] = losses[-1]
    order = sorted(roots, key=lambda key: (-key[1], -key[0]))
    for k, (s, mb) in enumerate(order):
        for ahead in order[k:k + 2]:
            saved.prefetch(ahead)
        grad = None if s == len(stages) - 1 else stage_inputs[(s + 1, mb)].grad
        torch.autograd.backward(roots.pop((s, mb)), grad)
        saved.release((s, mb))
    assert saved.keys() == []
    return torch.stack(losses).detach(), [p.grad for p in params], saved.stats


@pytest.mark.unit
def test_pipeline_order_with_offload_gives_the_same_loss_and_gradients():
    want_loss, want_grads, _ = _pipeline("cpu", offload=False, width=16, length=24)
    loss, grads, stats = _pipeline("cpu", offload=True, width=16, length=24)
    assert stats.offloaded == stats.reloaded > 0
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_with_offload_gives_the_same_loss_and_gradients():
    # Large activations (tens of MB per stage): a reload that does not wait for its offload copy
    # would read a half-written host buffer.
    want_loss, want_grads, _ = _pipeline("cuda", offload=False, width=256, length=512)
    loss, grads, stats = _pipeline("cuda", offload=True, width=256, length=512)
    assert stats.offloaded == stats.reloaded > 0
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
