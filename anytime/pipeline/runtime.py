"""Pipeline executor: runs any `Schedule` from `anytime.pipeline.schedule`, one process per rank.

Each rank walks its own action list in order:
- F  receive the stage input (or take the microbatch's tokens on stage 0), run the stage
     forward, keep the output (or the loss on the last stage) as the backward root, send the
     output on;
- I  receive the output gradient, backpropagate with weight GEMMs deferred (`splitgrad`), send
     the input gradient back;
- W  run the deferred weight GEMMs of that (stage, microbatch);
- B  fused backward (I and W at once).

Hand-overs between two stages on the same rank (V placement) stay local. Cross-rank tensors
travel by `isend`/`irecv`. Receives are posted early (`prefetch` actions ahead) and waited only
right before the compute that needs them. Per direction of a rank pair, receives are posted in
the sender's send order: NCCL matches point-to-point messages by order, not tag, so this order
(and one process group per direction, see `p2p_groups`) is what makes early posting deadlock-free
there; gloo also gets distinct tags. Building the executor sends one message over every link of
the schedule in one order on every rank (`p2p_links`), so that NCCL's lazily created communicators
all exist, created in that order, before the first step.

`anytime.pipeline.causal_lm.PipelinedCausalLM` builds the stages of a HF causal LM and the optimizer on
top of this executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from anytime.pipeline.offload import OffloadStats, SavedActivations
from anytime.pipeline.schedule import Action, Schedule
from anytime.pipeline.splitgrad import WeightGradStore, convert_linears

FORWARD_TAG_BASE = 1 << 20   # tags of the forward-only pass, apart from the training step's
TIED_TAG_BASE = 1 << 21      # tags of the tied-weight gradient exchange
WARM_UP_TAG_BASE = 1 << 22   # tags of the communicator warm-up

Key = tuple[str, int, int]   # ("F", stage, mb): input activation of stage; ("G", stage, mb): grad of its output


def p2p_groups(group: dist.ProcessGroup | None = None) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
    """(group, reverse): messages to a higher pipeline rank use `group`, to a lower one `reverse`.

    NCCL runs one communicator and stream per rank pair and group (created lazily: the process
    group is not bound to a device, see `anytime.core.dist.init_from_env`), so a receive posted
    early from a peer could sit in front of a send that peer is waiting for; separate groups per
    direction rule that out. Collective over the default group (every process must call it).
    """
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return group, dist.new_group(ranks=ranks)


def p2p_links(schedule: Schedule, tied: Sequence[tuple[tuple[int, str], tuple[int, str]]] = ()
              ) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of pipeline ranks the executor sends over under `schedule`, in
    one fixed order: by rank pair, then the message to the higher rank (over `group`) before the one
    to the lower rank (over the reverse group). Each link is one NCCL communicator, (group, rank pair).

    Activations cross each stage boundary between two ranks one way and gradients the other (the
    forward-only pass uses a subset); the holders of a tied weight exchange gradients both ways.
    Depends on the schedule alone, so every rank computes the same list.
    """
    pairs = [(schedule.placement[s], schedule.placement[s + 1]) for s in range(schedule.stages - 1)]
    pairs += [(schedule.placement[a], schedule.placement[b]) for (a, _), (b, _) in tied]
    links = {link for a, b in pairs if a != b for link in ((a, b), (b, a))}
    return sorted(links, key=lambda link: (min(link), max(link), link[0] > link[1]))


def forward_only_actions(schedule: Schedule) -> dict[int, list[Action]]:
    """Pipelined inference order for the schedule's placement: F(s, j) runs in wavefront order
    s + j, so every rank overlaps microbatches whatever the placement (loop or V)."""
    out: dict[int, list[Action]] = {r: [] for r in range(schedule.ranks)}
    order = sorted((s + j, s, j) for s in range(schedule.stages) for j in range(schedule.microbatches))
    for _, s, j in order:
        out[schedule.placement[s]].append(Action(s, "F", j))
    return out


def _message(action: Action, nstages: int) -> tuple[Key, int, int] | None:
    """(key, producer stage, consumer stage) of what `action` needs from another stage, or None."""
    s, j = action.stage, action.microbatch
    if action.kind == "F" and s > 0:
        return ("F", s, j), s - 1, s
    if action.kind in ("I", "B") and s < nstages - 1:
        return ("G", s, j), s + 1, s
    return None


def _produced(action: Action, nstages: int) -> tuple[Key, int] | None:
    """(key, consumer stage) of what `action` sends to another stage, or None."""
    s, j = action.stage, action.microbatch
    if action.kind == "F" and s < nstages - 1:
        return ("F", s + 1, j), s + 1
    if action.kind in ("I", "B") and s > 0:
        return ("G", s - 1, j), s - 1
    return None


class _MessagePlan:
    """For one set of action lists: per sender rank, the keys it sends to this rank, in order."""

    def __init__(self, actions: Mapping[int, Sequence[Action]], placement: Sequence[int], me: int) -> None:
        nstages = len(placement)
        self.from_rank: dict[int, list[Key]] = {}
        self.index: dict[Key, tuple[int, int]] = {}
        for src, acts in actions.items():
            if src == me:
                continue
            for a in acts:
                out = _produced(a, nstages)
                if out is not None and placement[out[1]] == me:
                    seq = self.from_rank.setdefault(src, [])
                    self.index[out[0]] = (src, len(seq))
                    seq.append(out[0])
        self.send_index: dict[Key, int] = {}
        counts: dict[int, int] = {}
        for a in actions[me]:
            out = _produced(a, nstages)
            if out is not None and placement[out[1]] != me:
                dst = placement[out[1]]
                self.send_index[out[0]] = counts.get(dst, 0)
                counts[dst] = counts.get(dst, 0) + 1


@dataclass
class StepStats:
    """What one executed step measured on this rank (times in seconds, memory in bytes)."""

    losses: list[float] = field(default_factory=list)          # per microbatch, last stage only
    outputs: dict[int, object] = field(default_factory=dict)   # per microbatch, from loss_fn/output_fn
    timeline: list[tuple[str, float, float]] = field(default_factory=list)  # (action, compute start, end)
    wall: float = 0.0
    busy: float = 0.0   # compute time, waits for receives excluded
    peak_saved_bytes: int = 0
    offload: OffloadStats | None = None


@dataclass
class _Step:
    """State of one step in flight: inputs, tensors in transit and backward roots."""

    train: bool
    plan: _MessagePlan
    tag_base: int
    boundary: tuple[tuple[int, ...], torch.dtype]
    first_input: Callable[[int], torch.Tensor]
    stage_kwargs: Callable[[int, int], dict]
    loss_fn: Callable | None = None
    output_fn: Callable | None = None
    loss_scale: float = 1.0
    stats: StepStats = field(default_factory=StepStats)
    local: dict[Key, torch.Tensor] = field(default_factory=dict)         # same-rank hand-overs
    recvs: dict[Key, tuple[object, torch.Tensor]] = field(default_factory=dict)
    next_recv: dict[int, int] = field(default_factory=dict)               # per sender: next index to post
    sends: list[tuple[object, torch.Tensor]] = field(default_factory=list)
    roots: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)   # outputs / losses to backprop
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # stage inputs awaiting .grad


class PipelineExecutor:
    """Runs a schedule's actions for the stages this rank owns.

    `stages` maps stage id → module (`forward(x, **kwargs)`); its `nn.Linear` layers are switched
    to `SplitLinear` in place so I and W can be separated. `tied` lists parameter pairs
    ((stage, name), (stage, name)) that are one weight in the full model (tied embeddings): their
    gradients are summed across the two holders at the end of every step. `offload_chunks` are
    chunk indices (0 = this rank's first stage) whose saved activations go to host memory.
    Construction is collective over the pipeline: it warms up every point-to-point link.
    """

    def __init__(self, stages: Mapping[int, nn.Module], schedule: Schedule, *,
                 group: dist.ProcessGroup | None = None, reverse_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, offload_chunks: Iterable[int] = (),
                 prefetch: int = 2, tied: Sequence[tuple[tuple[int, str], tuple[int, str]]] = (),
                 track_memory: bool = True) -> None:
        schedule.validate()
        if not dist.is_initialized():
            raise ValueError("PipelineExecutor needs an initialised torch.distributed process group "
                             "(one process per pipeline rank)")
        self.group, self.schedule = group, schedule
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != schedule.ranks:
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.ranks} ranks but the process group "
                             f"has {size}; build the schedule with ranks={size}")
        mine = sorted(s for s, r in enumerate(schedule.placement) if r == self.rank)
        if sorted(stages) != mine:
            raise ValueError(f"rank {self.rank} must hold stages {mine} under placement {schedule.placement}, "
                             f"got {sorted(stages)}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        offload_chunks = set(offload_chunks)
        if not offload_chunks <= set(range(schedule.chunks)):
            raise ValueError(f"offload_chunks={sorted(offload_chunks)} must be chunk indices in "
                             f"0..{schedule.chunks - 1}")
        if reverse_group is None and "nccl" in str(dist.get_backend(group)):
            _, reverse_group = p2p_groups(group)
        self.reverse_group = reverse_group if reverse_group is not None else group
        self.stages = dict(stages)
        self.nstages = schedule.stages
        self.offload_stages = {s for c, s in enumerate(mine) if c in offload_chunks}
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.prefetch, self.track_memory = prefetch, track_memory
        self.store = WeightGradStore()
        for module in self.stages.values():
            convert_linears(module, self.store)
        self.saved = SavedActivations(self.device, [p for m in self.stages.values() for p in m.parameters()])
        self.tied = [tuple(pair) for pair in tied]
        self._forward_actions = forward_only_actions(schedule)
        self._plans = {"train": _MessagePlan(schedule.actions, schedule.placement, self.rank),
                       "forward": _MessagePlan(self._forward_actions, schedule.placement, self.rank)}
        self._global = {r: (dist.get_global_rank(group, r) if group is not None else r) for r in range(size)}
        self._warm_up_links()

    # -- public API ----------------------------------------------------------------------------
    def train_step(self, first_input: Callable[[int], torch.Tensor], loss_fn: Callable[[torch.Tensor, int], object],
                   boundary: tuple[Sequence[int], torch.dtype], *,
                   stage_kwargs: Callable[[int, int], dict] | None = None, loss_scale: float = 1.0,
                   timeline: bool = False) -> StepStats:
        """One forward + backward of all microbatches; gradients accumulate in `.grad`.

        `first_input(mb)` gives stage 0's input; `loss_fn(output, mb)` the last stage's loss for
        that microbatch (a scalar, or (scalar, extra)), already weighted so that the sum over
        microbatches is the full-batch loss, times `loss_scale` (pass 1/m for per-microbatch means).
        `boundary` is the (shape, dtype) of every tensor crossing a stage boundary.
        """
        step = _Step(True, self._plans["train"], 0, (tuple(boundary[0]), boundary[1]), first_input,
                     stage_kwargs or _no_kwargs, loss_fn=loss_fn, loss_scale=loss_scale)
        return self._run(step, self.schedule.actions[self.rank], timeline)

    @torch.no_grad()
    def forward(self, first_input: Callable[[int], torch.Tensor], output_fn: Callable[[torch.Tensor, int], object],
                boundary: tuple[Sequence[int], torch.dtype], *,
                stage_kwargs: Callable[[int, int], dict] | None = None) -> StepStats:
        """Forward-only pipelined pass; `output_fn(last stage output, mb)` results land in `.outputs`."""
        step = _Step(False, self._plans["forward"], FORWARD_TAG_BASE, (tuple(boundary[0]), boundary[1]),
                     first_input, stage_kwargs or _no_kwargs, output_fn=output_fn)
        return self._run(step, self._forward_actions[self.rank], False)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self, step: _Step, actions: Sequence[Action], timeline: bool) -> StepStats:
        stats = step.stats
        step.next_recv = {src: 0 for src in step.plan.from_rank}
        handlers = {"F": self._forward, "I": self._backward, "B": self._backward, "W": self._weight}
        start = time.perf_counter()
        try:
            for k, action in enumerate(actions):
                self._post_recvs(step, actions, k)
                self._prefetch_offloaded(actions, k)
                begin = handlers[action.kind](step, action)
                end = time.perf_counter()
                stats.busy += end - begin
                if timeline:
                    stats.timeline.append((str(action), begin - start, end - start))
                if self.track_memory and step.train:
                    live = self.saved.device_bytes() + self.store.pending_bytes()
                    stats.peak_saved_bytes = max(stats.peak_saved_bytes, live)
                if step.sends:
                    step.sends = [(w, t) for w, t in step.sends if not w.is_completed()]
            for work, _ in step.sends:
                work.wait()
            if step.train:
                left = self.store.keys() + self.saved.keys() + list(step.roots) + list(step.local) + list(step.recvs)
                if left:
                    raise RuntimeError(f"rank {self.rank}: schedule {self.schedule.name!r} ended with work left: "
                                       f"{left[:8]}")
                self._sync_tied_grads()
        finally:
            self.store.clear()  # a failed step must not leak into the next one
            self.saved.clear()
        stats.wall = time.perf_counter() - start
        stats.offload = self.saved.stats
        return stats

    # -- actions --------------------------------------------------------------------------------
    def _forward(self, step: _Step, a: Action) -> float:
        s, j = a.stage, a.microbatch
        if s == 0:
            x = step.first_input(j).to(self.device)
        else:
            x = self._take(step, ("F", s, j))
            if step.train:
                x = x.detach().requires_grad_()
                step.inputs[(s, j)] = x
        begin = time.perf_counter()
        kwargs = step.stage_kwargs(s, j)
        if step.train:
            with self.store.recording((s, j)), self.saved.forward((s, j), offload=s in self.offload_stages):
                out = self.stages[s](x, **kwargs)
        else:
            out = self.stages[s](x, **kwargs)
        if s < self.nstages - 1:
            if step.train:
                step.roots[(s, j)] = out
            self._give(step, ("F", s + 1, j), out.detach())
        elif step.train:
            result = step.loss_fn(out, j)
            loss, extra = result if isinstance(result, tuple) else (result, None)
            loss = loss * step.loss_scale if step.loss_scale != 1.0 else loss
            step.roots[(s, j)] = loss
            step.stats.losses.append(float(loss.detach()))
            if extra is not None:
                step.stats.outputs[j] = extra
        else:
            step.stats.outputs[j] = step.output_fn(out, j)
        return begin

    def _backward(self, step: _Step, a: Action) -> float:
        s, j = a.stage, a.microbatch
        root = step.roots.pop((s, j))
        grad = None if s == self.nstages - 1 else self._take(step, ("G", s, j))
        begin = time.perf_counter()
        with self.store.deferring(a.kind == "I"):
            torch.autograd.backward(root, grad)
        del root, grad
        self.saved.release((s, j))
        if s > 0:
            x = step.inputs.pop((s, j))
            self._give(step, ("G", s - 1, j), x.grad if x.grad is not None else torch.zeros_like(x))
        return begin

    def _weight(self, step: _Step, a: Action) -> float:
        begin = time.perf_counter()
        self.store.flush((a.stage, a.microbatch))
        return begin

    # -- communication ---------------------------------------------------------------------------
    def _give(self, step: _Step, key: Key, tensor: torch.Tensor) -> None:
        dst = self.schedule.placement[key[1]]
        if dst == self.rank:
            step.local[key] = tensor
            return
        tensor = tensor.contiguous()
        group = self.group if dst > self.rank else self.reverse_group
        tag = step.tag_base + step.plan.send_index[key]
        step.sends.append((dist.isend(tensor, self._global[dst], group=group, tag=tag), tensor))

    def _take(self, step: _Step, key: Key) -> torch.Tensor:
        if key in step.local:
            return step.local.pop(key)
        self._post_until(step, key)
        work, buf = step.recvs.pop(key)
        work.wait()
        return buf

    def _post_until(self, step: _Step, key: Key) -> None:
        """Post the receives from `key`'s sender up to `key`, in the sender's send order."""
        src, index = step.plan.index[key]
        seq = step.plan.from_rank[src]
        group = self.group if self.rank > src else self.reverse_group
        shape, dtype = step.boundary
        while step.next_recv[src] <= index:
            k = step.next_recv[src]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            step.recvs[seq[k]] = (dist.irecv(buf, self._global[src], group=group, tag=step.tag_base + k), buf)
            step.next_recv[src] = k + 1

    def _post_recvs(self, step: _Step, actions: Sequence[Action], k: int) -> None:
        for a in actions[k:k + 1 + self.prefetch]:
            need = _message(a, self.nstages)
            if need is not None and self.schedule.placement[need[1]] != self.rank:
                self._post_until(step, need[0])

    def _prefetch_offloaded(self, actions: Sequence[Action], k: int) -> None:
        """Start reloading offloaded activations one action before the backward needs them."""
        if self.offload_stages:
            for a in actions[k:k + 2]:
                if a.kind in ("I", "B") and a.stage in self.offload_stages:
                    self.saved.prefetch((a.stage, a.microbatch))

    def _warm_up_links(self) -> None:
        """One blocking message over every link of `p2p_links`, in its order, on every rank.

        NCCL creates a point-to-point communicator at the first send or receive of its (group, rank
        pair), and creating it blocks until the peer creates the same one: ranks whose first
        messages go over different communicators wait for each other forever (ZB-H1's stage 0
        first posts a gradient receive over the reverse group while stage 1 first posts an
        activation receive over the forward one). Here every rank meets its links in one global
        order, so the earliest unfinished link always has both its ranks at it: all get created.
        No link (a world of one, every stage on one rank): nothing is sent.
        """
        for n, (src, dst) in enumerate(p2p_links(self.schedule, self.tied)):
            if self.rank not in (src, dst):
                continue
            group = self.group if dst > src else self.reverse_group
            probe = torch.zeros(1, device=self.device)
            if self.rank == src:
                dist.send(probe, self._global[dst], group=group, tag=WARM_UP_TAG_BASE + n)
            else:
                dist.recv(probe, self._global[src], group=group, tag=WARM_UP_TAG_BASE + n)

    # -- tied weights ----------------------------------------------------------------------------
    def _sync_tied_grads(self) -> None:
        """Sum the gradients of each tied pair so both holders step identically."""
        for n, ((sa, na), (sb, nb)) in enumerate(self.tied):
            ra, rb = self.schedule.placement[sa], self.schedule.placement[sb]
            if self.rank not in (ra, rb):
                continue
            if ra == rb:
                pa, pb = self.stages[sa].get_parameter(na), self.stages[sb].get_parameter(nb)
                if pa is not pb:
                    total = _grad(pa) + _grad(pb)
                    pa.grad, pb.grad = total, total.clone()
                continue
            mine = self.stages[sa].get_parameter(na) if self.rank == ra else self.stages[sb].get_parameter(nb)
            peer = rb if self.rank == ra else ra
            own = _grad(mine).contiguous()
            other = torch.empty_like(own)
            to_peer = self.group if peer > self.rank else self.reverse_group
            from_peer = self.group if self.rank > peer else self.reverse_group
            recv = dist.irecv(other, self._global[peer], group=from_peer, tag=TIED_TAG_BASE + n)
            send = dist.isend(own, self._global[peer], group=to_peer, tag=TIED_TAG_BASE + n)
            recv.wait()
            send.wait()
            # Same operand order on both ranks: the two copies stay bitwise equal.
            mine.grad = own + other if self.rank == ra else other + own


def _no_kwargs(stage: int, mb: int) -> dict:
    return {}


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
