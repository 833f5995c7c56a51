"""1F1B (PipeDream-Flush) and interleaved 1F1B (Megatron virtual pipeline) with fused backwards."""

from __future__ import annotations

from anytime.pipeline.schedule import Action, Generator, Schedule, ScheduleRequest, loop_placement


def one_f_one_b(req: ScheduleRequest) -> Schedule:
    """Rank i: min(p-1-i, m) warm-up forwards, then alternate F and fused B, then the last B's.

    Idle per rank is (p-1)(T_F+T_B+T_W) and rank 0 holds p microbatches at its peak.
    """
    p, m = req.ranks, req.microbatches
    actions: dict[int, list[Action]] = {}
    for i in range(p):
        warmup = min(p - 1 - i, m)
        order = [Action(i, "F", j) for j in range(warmup)]
        for k in range(m - warmup):
            order += [Action(i, "F", warmup + k), Action(i, "B", k)]
        order += [Action(i, "B", k) for k in range(m - warmup, m)]
        actions[i] = order
    return Schedule("1f1b", p, m, 1, loop_placement(p, 1), actions)


def interleaved_1f1b(req: ScheduleRequest) -> Schedule:
    """Loop placement, v chunks per rank; microbatches go through the chunks in rounds of R.

    R = m / max(1, m // p) microbatches per round (so m must be divisible by max(1, m // p), as in
    PyTorch's ScheduleInterleaved1F1B; m % p == 0 always works). Forward op k of a rank runs chunk
    (k // R) % v, backward op k chunk v-1-(k // R) % v. Rank i warms up with (v-1)R + 2(p-1-i)
    forwards so its first backward arrives just as they end.
    """
    p, m, v = req.ranks, req.microbatches, req.chunks
    rounds = max(1, m // p)
    if m % rounds:
        ok = sorted({n for n in range(max(1, m - p), m + p + 1) if n % max(1, n // p) == 0})
        raise ValueError(
            f"interleaved-1f1b needs microbatches divisible by max(1, m // p) = {rounds}; "
            f"m={m} is not (try one of {ok}, or any multiple of p={p})"
        )
    per_round = m // rounds
    total = m * v

    def op_action(rank: int, k: int, forward: bool) -> Action:
        chunk = (k // per_round) % v
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (per_round * v)) * per_round + k % per_round
        return Action(chunk * p + rank, "F" if forward else "B", mb)

    actions: dict[int, list[Action]] = {}
    for i in range(p):
        warmup = min((v - 1) * per_round + 2 * (p - 1 - i), total)
        order = [op_action(i, k, True) for k in range(warmup)]
        for k in range(total - warmup):
            order += [op_action(i, warmup + k, True), op_action(i, k, False)]
        order += [op_action(i, k, False) for k in range(total - warmup, total)]
        actions[i] = order
    return Schedule("interleaved-1f1b", p, m, v, loop_placement(p, v), actions)


ONE_F_ONE_B = Generator(one_f_one_b)
INTERLEAVED_1F1B = Generator(interleaved_1f1b, 2, lambda v: v >= 2, "chunks must be >= 2")
