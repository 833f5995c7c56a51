"""GPU smoke benchmark: the GPU tier's runs (tests/gpu/workloads.py) one by one, riskiest first, each
checked as its test checks it and timed, inside a time budget.

A GPU machine is lent for minutes, so the first minutes must say the most. The runs go in `ORDER`:
first what has never run on a GPU and would hang rather than fail (the NCCL pipeline's send/recv pairs,
two colocated engines sleeping beside two learner ranks, CUDA IPC handles into an engine core of its
own, `anytime serve` at a budget, vLLM's LoRA kernels), then the rest, and last every other test of the
`gpu` tier under pytest. The tier is not run first, whole, as before: its tests are these workloads,
so it would run each of them twice and spend the budget before any figure. Each training run is its
workload's own `anytime train` process with its test's checks applied here (defined once, in
tests/gpu/workloads.py); a probe (`anytime serve`) and the rest of the tier run as their pytest tests.

Each run gets the smaller of its own limit and the budget left, less the time an overrun takes to
stop; one that overruns is ended whole (its process group, then every process that still carries its
mark in its environment: servers and engine cores in sessions of their own) and fails naming itself.
A run left less than half its limit is not started (`skipped_<name>: budget`), so the smoke ends
inside the budget with the runs it started complete or cut by their own limits.

Prints ``name: value`` lines:
  <workload>_step_s                median seconds of a training step after the first (`time/step`; the
                                   first compiles kernels)
  <workload>_sync_s                median seconds of the weight sync into the engines (`time/sync`)
  <workload>_rollout_tokens_per_s  median rollout tokens per second (`perf/rollout_tokens_per_s`)
  <workload>_peak_gpu_mem_gb       peak device memory in use during the run, every process and GPU
                                   together (learners, engine cores), less what was in use before it;
                                   sampled every 0.2 s (the runs are processes of their own, so
                                   `torch.cuda.max_memory_allocated` here would see none of it)
  <workload>_wall_s                the whole run: start-up, engines, warm start, steps, evals
  <probe>                          passed, failed or skipped, with pytest's counts (also _wall_s and
                                   _peak_gpu_mem_gb)
  pytest_gpu_tier                  the same for every other `gpu` test (`pytest -m gpu`, less the above)
  skipped_<name>                   why it did not run: what this machine lacks (no vLLM, one GPU, ...),
                                   or `budget`
  failed_<name>                    how a run failed: its exit, its overrun or its check (its output's
                                   end goes to stderr)
  left_behind_<name>               processes of a finished run still alive after it (killed)
  gpu_smoke_wall_s                 the whole smoke

Exit status 0 when everything ran, or was skipped, and passed; 1 when a run failed; 2, with one line
and nothing run, on a machine without a CUDA device. `--plan` prints the order, each run's GPUs,
limit, needs and checks, and the worst case under the budget (every run taking its whole limit), and
exits 0 without a GPU and without starting anything.

Usage: python benchmarks/gpu_smoke.py [--budget-s S] [--workloads NAME,NAME] [--steps N] [--no-pytest]
       python benchmarks/gpu_smoke.py --plan [--budget-s S] [--gpus N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a script from anywhere; the workloads live with their tests

from tests.gpu.workloads import KILL_WAIT_S, NEEDS, PROBES, WORKLOADS, Probe, Workload  # noqa: E402

NO_CUDA = ("gpu_smoke: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
SAMPLE_S = 0.2
TIER = "pytest_gpu_tier"
# The runs by risk: what would hang rather than fail, and what no GPU has run, first. On one GPU the
# two-GPU runs are skipped at no cost, so the one-GPU runs after them start at once.
ORDER = (
    "pipeline_zbh1_nccl",              # NCCL send/recv of a zero-bubble schedule: a mismatched pair hangs
    "colocated_vllm_sleep_two_ranks",  # sleep mode (none on the CPU) beside 2 NCCL learner ranks, 2 engines
    "asyncllm_ipc",                    # CUDA IPC handles into an engine core of its own: a bad one hangs the client
    "serve_at_budget",                 # vLLM's CUDA sampler under its reasoning budget and our logits processor
    "lora_vllm_adapter",               # vLLM's LoRA kernels, a LoRARequest a step (the CPU takes merged weights)
    "quickstart_vllm_sleep",           # sleep mode on one GPU: the only sleep/wake run a one-GPU machine has
    "inflight_asyncllm_ipc",           # in-flight swaps into an engine core on GPU 1
    "deepspeed_ray_nccl",              # a Ray actor's NCCL group with learner rank 0
    "deepspeed_two_ranks",             # ZeRO-3 bf16 over NCCL
    "pipeline_deepspeed_zero2_bf16",   # the paper's 7B mesh scaled down: ZeRO-2 stages on the pipeline
    "paper_vllm",                      # the paper's recipe on vLLM: FlexAttention's compiled kernel
    "deepspeed_zero3_bf16",            # FusedAdam's JIT build (minutes), one GPU
    "paper_hf",                        # the paper's recipe on the transformers engine
    TIER,                              # every other gpu test: small, in-process, least likely to hang
)
TIER_ITEM = Probe(TIER, "every other `gpu` test (pytest -m gpu, less the tests of the runs above): the bf16 "
                  "learner step, CUDA activation offload", test="", limit_s=300)
INTERRUPT_WAIT_S = 10  # a pytest run's own clean-up after SIGINT (its test's finally blocks stop servers)
SWEEP_S = 10           # the survivors of a run: a few seconds to go by themselves, then killed (`end_marked`)
# The longest an overrun run takes to stop: SIGINT (pytest runs), SIGKILL to its group, the sweep.
STOP_MARGIN_S = INTERRUPT_WAIT_S + KILL_WAIT_S + SWEEP_S
# A run given less than half its limit (a guess at 2-3x its time) would likely only be cut: not started.
SHORTEST_SHARE = 0.5
MARK = "ANYTIME_GPU_SMOKE_RUN"   # in the environment of every process a run starts, to find survivors

Item = Workload | Probe


def smoke_items(names: Sequence[str] | None = None) -> list[Item]:
    """The runs in smoke order (`ORDER`; a workload it does not name goes before the tier, never
    dropped), only `names` where given."""
    every = {**WORKLOADS, **PROBES, TIER: TIER_ITEM}
    order = [n for n in ORDER if n in every] + [n for n in every if n not in ORDER]
    order = [n for n in order if n != TIER] + [TIER]
    return [every[n] for n in order if names is None or n in names]


def timeout_for(item: Item, left_s: float | None) -> int | None:
    """How long `item` may run with `left_s` of the budget left (None: no budget): its limit, or less
    to leave time to stop it; None when that is too short to be worth starting (`SHORTEST_SHARE`)."""
    if left_s is None:
        return item.limit_s
    usable = int(left_s - STOP_MARGIN_S)
    return None if usable < SHORTEST_SHARE * item.limit_s else min(item.limit_s, usable)


@dataclass(frozen=True)
class Planned:
    """One run of the plan: when it starts and how long it may take in the worst case, or why not."""

    item: Item
    start_s: int | None
    timeout_s: int | None
    verdict: str


def plan(budget_s: float | None, gpus: int, names: Sequence[str] | None = None) -> list[Planned]:
    """The smoke's runs on a machine with `gpus` GPUs and every library, in order, in the worst case:
    every run takes its whole timeout and then the time to stop it. A run marked `budget` starts only
    if those before it end early."""
    planned, elapsed = [], 0
    for item in smoke_items(names):
        if item.gpus > gpus:
            planned.append(Planned(item, None, None, f"needs {item.gpus} GPUs"))
            continue
        timeout = timeout_for(item, None if budget_s is None else budget_s - elapsed)
        if timeout is None:
            planned.append(Planned(item, None, None, "budget"))
            continue
        verdict = "runs" if timeout == item.limit_s else f"cut to {timeout} s"
        planned.append(Planned(item, elapsed, timeout, verdict))
        elapsed += timeout + STOP_MARGIN_S
    return planned


def render_plan(planned: list[Planned], budget_s: float | None, gpus: int) -> str:
    budget = "no budget" if budget_s is None else f"budget {budget_s:g} s"
    lines = [f"gpu_smoke plan: {budget}, {gpus} GPU(s); worst case: every run takes its whole timeout and "
             f"{STOP_MARGIN_S} s to stop; 'budget' = starts only if earlier runs end early",
             f"{'#':>2}  {'run':<31} {'gpus':>4} {'limit_s':>7} {'start_s':>7} {'timeout_s':>9}  "
             f"{'plan':<13} needs"]
    for i, p in enumerate(planned, 1):
        needs = ", ".join(["CUDA", *(NEEDS[n].removeprefix("needs ") for n in p.item.needs)])
        start = "-" if p.start_s is None else str(p.start_s)
        timeout = "-" if p.timeout_s is None else str(p.timeout_s)
        lines.append(f"{i:>2}  {p.item.name:<31} {p.item.gpus:>4} {p.item.limit_s:>7} {start:>7} {timeout:>9}  "
                     f"{p.verdict:<13} {needs}")
        lines.append(f"{'':>4}checks: {p.item.what}")
    return "\n".join(lines)


class PeakMemory:
    """Device memory in use on every GPU together (total - free, all processes), its peak sampled by a
    thread between `start` and `stop`, less what was in use at `start`."""

    def __init__(self) -> None:
        import torch

        self._torch, self._stop = torch, threading.Event()
        self._base = self._peak = self._used()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _used(self) -> int:
        cuda = self._torch.cuda
        return sum(total - free for free, total in (cuda.mem_get_info(i) for i in range(cuda.device_count())))

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._peak = max(self._peak, self._used())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def gb(self) -> float:
        return max(0, self._peak - self._base) / 1e9


def end_marked(token: str, settle_s: float = SWEEP_S / 3) -> int:
    """Kill every process that still carries `token` in its environment (what a run started in sessions
    of its own: a server, engine cores, Ray workers), after `settle_s` for those already on their way
    out; how many were killed."""
    import psutil

    def marked() -> list:
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE and \
                        proc.environ().get(MARK) == token:
                    found.append(proc)
        return found

    deadline = time.monotonic() + settle_s
    while (left := marked()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=SWEEP_S / 3)
    return len(left)


@contextlib.contextmanager
def marked_run(name: str):
    """Every process started inside the block carries this run's mark; the block ends with none alive."""
    token = f"{os.getpid()}-{name}"
    os.environ[MARK] = token
    try:
        yield token
    finally:
        del os.environ[MARK]
        left = end_marked(token)
        if left:
            print(f"left_behind_{name}: {left} processes (killed)")


def _median(metrics: dict[int, dict], key: str, skip_first: bool) -> float:
    steps = sorted(metrics)
    chosen = steps[1:] if skip_first and len(steps) > 1 else steps
    values = [metrics[s][key] for s in chosen if key in metrics[s]]
    return statistics.median(values) if values else float("nan")


def time_workload(workload: Workload, steps: int | None, timeout_s: int) -> bool:
    """Run one workload within `timeout_s`, check it as its test does and print its figures; returns
    whether it ran and passed."""
    from tests.gpu.workloads import RunFailed, train

    name = workload.name
    # the survivors are ended (marked_run) before their folder is removed
    with tempfile.TemporaryDirectory(prefix=f"gpu-smoke-{name}-", ignore_cleanup_errors=True) as folder, \
            marked_run(name), PeakMemory() as memory:
        start = time.perf_counter()
        try:
            run = train(workload, Path(folder), steps, timeout_s=timeout_s)
        except RunFailed as exc:
            print(f"failed_{name}: {str(exc).splitlines()[0]}")
            print(str(exc), file=sys.stderr)
            return False
        except Exception as exc:   # e.g. no metrics.jsonl after exit 0: this run's failure, not the smoke's
            print(f"failed_{name}: {type(exc).__name__}: {exc}")
            return False
        wall = time.perf_counter() - start
        try:
            workload.check(run)
            passed = True
        except Exception as exc:   # an assertion, or a metric the run did not log (KeyError)
            first = (str(exc).splitlines() or [""])[0]
            print(f"failed_{name}: check: {type(exc).__name__}: {first[:300]}")
            print(f"{name}: check failed: {exc!r}\n{run.log[-4000:]}", file=sys.stderr)
            passed = False
    metrics = run.metrics
    print(f"{name}_step_s: {_median(metrics, 'time/step', skip_first=True):.3f}")
    print(f"{name}_sync_s: {_median(metrics, 'time/sync', skip_first=False):.4f}")
    print(f"{name}_rollout_tokens_per_s: {_median(metrics, 'perf/rollout_tokens_per_s', skip_first=True):.0f}")
    print(f"{name}_peak_gpu_mem_gb: {memory.gb:.2f}")
    print(f"{name}_wall_s: {wall:.1f}")
    return passed


def pytest_targets(item: Probe) -> list[str]:
    """What pytest runs for `item`: its test, or for the tier every `gpu` test no other run holds."""
    if item.name != TIER:
        return [item.test]
    held = [i.test for i in smoke_items() if i.name != TIER]
    return ["tests", *(arg for test in held for arg in ("--deselect", test))]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT first, so that pytest's clean-up (a test's finally blocks) stops what the test started,
    then SIGKILL for whatever is left of the group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=INTERRUPT_WAIT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_WAIT_S)


def run_pytest(item: Probe, timeout_s: int) -> bool:
    """`item`'s tests under pytest within `timeout_s`; prints its verdict and returns whether it passed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", *pytest_targets(item)]
    name = item.name
    # output to a file, not a pipe: a survivor in a session of its own could hold a pipe open
    with tempfile.TemporaryFile("w+") as log, marked_run(name), PeakMemory() as memory:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except BaseException as exc:   # an overrun, or the smoke interrupted: nothing of the run may outlive it
            _stop_group(proc)
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            log.seek(0)
            print(f"failed_{name}: ran past {timeout_s} s")
            print(log.read()[-6000:], file=sys.stderr)
            return False
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read()
    lines = [line.strip("= ") for line in output.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "skipped" in line
                                                                             or "failed" in line)), "no summary")
    passed = proc.returncode in (0, 5)   # 5: nothing collected to run (every test deselected)
    verdict = "failed" if not passed else "passed" if "passed" in summary or proc.returncode == 5 else "skipped"
    if not passed:
        print(output[-8000:], file=sys.stderr)
    print(f"{name}: {verdict} ({summary})")
    print(f"{name}_peak_gpu_mem_gb: {memory.gb:.2f}")
    print(f"{name}_wall_s: {wall:.1f}")
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, help="stop inside this many seconds (default: no budget)")
    parser.add_argument("--workloads", help="comma-separated names (default: every run, in smoke order)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: each workload's own)")
    parser.add_argument("--no-pytest", action="store_true", help="the training runs only: no probe, no tier")
    parser.add_argument("--plan", action="store_true", help="print the order and the worst case; start nothing")
    parser.add_argument("--gpus", type=int, default=1,
                        help="--plan: GPUs to plan for (default 1, what the lent machines have)")
    args = parser.parse_args(argv)
    every = [item.name for item in smoke_items()]
    names = args.workloads.split(",") if args.workloads else None
    unknown = [n for n in names or () if n not in every]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose among {', '.join(every)}")
    if args.plan:
        print(render_plan(plan(args.budget_s, args.gpus, names), args.budget_s, args.gpus))
        return 0
    started = time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from tests.gpu.workloads import missing

    ok = True
    for item in smoke_items(names):
        if args.no_pytest and isinstance(item, Probe):
            print(f"skipped_{item.name}: --no-pytest")
            continue
        reason = missing(item)
        if reason is not None:
            print(f"skipped_{item.name}: {reason}")
            continue
        left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started)
        timeout = timeout_for(item, left)
        if timeout is None:
            print(f"skipped_{item.name}: budget")
            continue
        if isinstance(item, Workload):
            ok = time_workload(item, args.steps, timeout) and ok
        else:
            ok = run_pytest(item, timeout) and ok
        sys.stdout.flush()
    print(f"gpu_smoke_wall_s: {time.monotonic() - started:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
