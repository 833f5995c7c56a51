"""Saved-activation accounting and activation offload (PipeOffload) for pipeline stages.

Every forward of a (stage, microbatch) runs inside `SavedActivations.forward(key, offload)`,
a `torch.autograd.graph.saved_tensors_hooks` context. It always accounts the memory the forward
saves for backward (the per-rank activation memory the schedule simulator predicts). For
offloaded chunks it also moves those activations to host memory when the forward ends and
brings them back before the backward: on CUDA into pinned buffers on side streams (D2H as the
forward ends, H2D started by `prefetch` one action ahead of the backward); on CPU the copies are
synchronous, which keeps the code path and the byte counts testable. The streams and events come
from a `streams` object (`torch.cuda` by default), so a test can check their ordering on the CPU.

Unit of accounting and transfer: the byte range of one storage that the saved views cover.
Saved tensors are often several views of one buffer (transposes, q/k/v splits): the range is
moved once and the views are rebuilt with `set_`. A view into a larger caller buffer (a row slice
of the whole batch) counts only its own rows. The copy waits for the end of the forward, when
every view is known; until then the original buffer stays referenced.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 4096  # smaller saved ranges are not worth a transfer
_ALIGN = 16               # range bounds are kept multiples of every element size


@dataclass
class _Range:
    """The bytes [lo, hi) of one storage that a record's saved views use."""

    storage: torch.UntypedStorage | None     # the original, until offloaded
    lo: int
    hi: int
    host: torch.Tensor | None = None         # uint8 copy of [lo, hi) on the host
    reloaded: torch.Tensor | None = None     # uint8 copy back on the device
    event: object | None = None              # CUDA event guarding the last copy

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


@dataclass
class _Record:
    offload: bool
    ranges: dict[int, _Range] = field(default_factory=dict)
    on_host: bool = False


@dataclass(frozen=True)
class _Handle:
    key: Hashable
    ptr: int
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass
class OffloadStats:
    """Counters over the life of a `SavedActivations` (bytes)."""

    offloaded: int = 0    # device → host
    reloaded: int = 0     # host → device
    freed: int = 0        # device bytes released when offloaded forwards ended
    peak_host: int = 0


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (last + 1) * size


def _keep_until_done(t: torch.Tensor, stream) -> None:
    """Keep `t`'s block from being reused until the work queued on `stream` is done (only CUDA's
    caching allocator hands a freed block to another stream's work)."""
    if t.is_cuda:
        t.record_stream(stream)


class SavedActivations:
    """Per-(stage, microbatch) records of activations saved for backward; optional offload.

    `params`: weights of the stages; ops that save views of weights (nn.Linear saves weight.t())
    are not activations and are neither counted nor moved. `streams`: what provides `Stream`,
    `Event`, `stream` and `current_stream` for the asynchronous copies; `torch.cuda` on a CUDA
    device, and none (synchronous copies) on the CPU unless a test passes a fake.
    """

    def __init__(self, device: torch.device | str = "cpu", params: Iterable[torch.Tensor] = (),
                 streams=None) -> None:
        self.device = torch.device(device)
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._records: dict[Hashable, _Record] = {}
        self.stats = OffloadStats()
        self._streams = torch.cuda if streams is None and self.device.type == "cuda" else streams
        if self._streams is not None:
            self._d2h = self._streams.Stream(self.device)
            self._h2d = self._streams.Stream(self.device)

    # -- forward -----------------------------------------------------------------------------
    @contextmanager
    def forward(self, key: Hashable, offload: bool = False) -> Iterator[None]:
        """Run a stage forward for `key`; with `offload`, its saved activations leave the device
        when the block exits."""
        if key in self._records:
            raise RuntimeError(f"saved activations for {key} already recorded (forward ran twice?)")
        record = self._records[key] = _Record(offload)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(key, record, t), self._unpack):
            yield
        if offload:
            self._offload(record)

    def _pack(self, key: Hashable, record: _Record, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.device.type != self.device.type or t.numel() == 0:
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages:
            return t
        lo, hi = _byte_span(t)
        lo, hi = lo // _ALIGN * _ALIGN, min(-(-hi // _ALIGN) * _ALIGN, storage.nbytes())
        rng = record.ranges.get(ptr)
        if rng is None:
            record.ranges[ptr] = _Range(storage, lo, hi)
        else:
            rng.lo, rng.hi = min(rng.lo, lo), max(rng.hi, hi)
        if not record.offload:
            return t  # kept on device: the graph holds the tensor itself
        return _Handle(key, ptr, t.dtype, t.storage_offset(), t.size(), t.stride())

    def _offload(self, record: _Record) -> None:
        for rng in record.ranges.values():
            if rng.nbytes < MIN_OFFLOAD_BYTES:
                continue
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(rng.storage)[rng.lo:rng.hi]
            if self._streams is not None:
                self._d2h.wait_stream(self._streams.current_stream(self.device))
                with self._streams.stream(self._d2h):
                    rng.host = torch.empty(rng.nbytes, dtype=torch.uint8, pin_memory=src.is_cuda)
                    rng.host.copy_(src, non_blocking=True)
                    rng.event = self._streams.Event()
                    rng.event.record(self._d2h)
                _keep_until_done(src, self._d2h)
            else:
                rng.host = src.clone()
            rng.storage = None
            self.stats.offloaded += rng.nbytes
            self.stats.freed += rng.nbytes
        record.on_host = True
        self.stats.peak_host = max(self.stats.peak_host, self.host_bytes())

    # -- backward ----------------------------------------------------------------------------
    def prefetch(self, key: Hashable) -> None:
        """Start bringing `key`'s offloaded activations back (no-op if none are on the host)."""
        record = self._records.get(key)
        if record is None or not record.on_host:
            return
        for rng in record.ranges.values():
            if rng.host is not None and rng.reloaded is None:
                self._reload(rng)

    def _reload(self, rng: _Range) -> None:
        if self._streams is not None:
            with self._streams.stream(self._h2d):
                # rng.event guards the D2H copy that fills rng.host, queued on another stream.
                self._h2d.wait_event(rng.event)
                dev = torch.empty(rng.nbytes, dtype=torch.uint8, device=self.device)
                dev.copy_(rng.host, non_blocking=True)
                rng.event = self._streams.Event()
                rng.event.record(self._h2d)
            _keep_until_done(dev, self._streams.current_stream(self.device))
            rng.reloaded = dev
        else:
            rng.reloaded = rng.host.clone()
        self.stats.reloaded += rng.nbytes

    def _unpack(self, packed):
        if not isinstance(packed, _Handle):
            return packed
        rng = self._records[packed.key].ranges[packed.ptr]
        out = torch.empty(0, dtype=packed.dtype, device=self.device)
        if rng.storage is not None:  # not moved (forward still running, or a tiny range)
            return out.set_(rng.storage, packed.offset, packed.size, packed.stride)
        if rng.reloaded is None:
            self._reload(rng)
        if rng.event is not None:
            self._streams.current_stream(self.device).wait_event(rng.event)
        offset = (packed.offset * out.element_size() - rng.lo) // out.element_size()
        return out.set_(rng.reloaded.untyped_storage(), offset, packed.size, packed.stride)

    def release(self, key: Hashable) -> None:
        """Forget `key` once its backward has run (the graph no longer needs the activations)."""
        self._records.pop(key, None)

    # -- accounting --------------------------------------------------------------------------
    def device_bytes(self, key: Hashable | None = None) -> int:
        """Saved-activation bytes resident on the device (one record or all)."""
        records = self._records.values() if key is None else [self._records[key]]
        return sum(r.nbytes for rec in records for r in rec.ranges.values()
                   if r.storage is not None or r.reloaded is not None)

    def host_bytes(self) -> int:
        return sum(r.nbytes for rec in self._records.values() for r in rec.ranges.values() if r.host is not None)

    def keys(self) -> list[Hashable]:
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()
