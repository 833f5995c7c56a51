"""GPU smoke benchmark: the GPU tier (`pytest -m gpu tests/gpu`) for pass/fail, then its workloads
(tests/gpu/workloads.py: the quickstart on vLLM with sleep mode, AsyncLLM with CUDA IPC weights, in flight,
DeepSpeed ZeRO-3 bf16, NCCL weight sync, the paper recipe scaled down) timed one by one, each as its own
`anytime train` run in a temporary folder.

Prints ``name: value`` lines:
  pytest_gpu_tier                  passed or failed, with pytest's counts
  <workload>_step_s                median seconds of a training step after the first (`time/step`; the
                                   first compiles kernels)
  <workload>_sync_s                median seconds of the weight sync into the engines (`time/sync`)
  <workload>_rollout_tokens_per_s  median rollout tokens per second (`perf/rollout_tokens_per_s`)
  <workload>_peak_gpu_mem_gb       peak device memory in use during the run, every process and GPU
                                   together (learners, engine cores), less what was in use before it;
                                   sampled every 0.2 s (the runs are processes of their own, so
                                   `torch.cuda.max_memory_allocated` here would see none of it)
  <workload>_wall_s                the whole run: start-up, engines, warm start, steps, evals
  skipped_<workload>               why this machine cannot run it (no vLLM, one GPU, ...)
  failed_<workload>                how a run failed (its output's end goes to stderr)

Exit status 0 when everything ran or was skipped, 1 when pytest or a run failed, and 2, with one line
and nothing run, on a machine without a CUDA device.

Usage: python benchmarks/gpu_smoke.py [--workloads NAME,NAME] [--steps N] [--no-pytest]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere; the workloads live with their tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

NO_CUDA = ("gpu_smoke: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
SAMPLE_S = 0.2


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


def run_tier() -> bool:
    """The GPU tier under pytest; prints its verdict and returns whether it passed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-rs", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = [line.strip("= ") for line in proc.stdout.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "skipped" in line
                                                                             or "failed" in line)), "no summary")
    passed = proc.returncode in (0, 5)   # 5: nothing collected to run (every test deselected)
    if not passed:
        print(proc.stdout[-6000:] + proc.stderr[-2000:], file=sys.stderr)
    print(f"pytest_gpu_tier: {'passed' if passed else 'failed'} ({summary})")
    return passed


def _median(metrics: dict[int, dict], key: str, skip_first: bool) -> float:
    steps = sorted(metrics)
    chosen = steps[1:] if skip_first and len(steps) > 1 else steps
    values = [metrics[s][key] for s in chosen if key in metrics[s]]
    return statistics.median(values) if values else float("nan")


def time_workload(workload, steps: int | None) -> bool:
    """Run one workload and print its figures; returns whether it ran."""
    from tests.gpu.workloads import RunFailed, train

    name = workload.name
    with tempfile.TemporaryDirectory(prefix=f"gpu-smoke-{name}-") as folder, PeakMemory() as memory:
        start = time.perf_counter()
        try:
            metrics = train(workload, Path(folder), steps)
        except RunFailed as exc:
            first = str(exc).splitlines()[0]
            print(f"failed_{name}: {first}")
            print(str(exc), file=sys.stderr)
            return False
        wall = time.perf_counter() - start
    print(f"{name}_step_s: {_median(metrics, 'time/step', skip_first=True):.3f}")
    print(f"{name}_sync_s: {_median(metrics, 'time/sync', skip_first=False):.4f}")
    print(f"{name}_rollout_tokens_per_s: {_median(metrics, 'perf/rollout_tokens_per_s', skip_first=True):.0f}")
    print(f"{name}_peak_gpu_mem_gb: {memory.gb:.2f}")
    print(f"{name}_wall_s: {wall:.1f}")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", help="comma-separated names (default: all of tests/gpu/workloads.py)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: each workload's own)")
    parser.add_argument("--no-pytest", action="store_true", help="time the workloads only")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from tests.gpu.workloads import WORKLOADS, missing

    names = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose among {', '.join(WORKLOADS)}")
    ok = args.no_pytest or run_tier()
    for name in names:
        reason = missing(WORKLOADS[name])
        if reason is not None:
            print(f"skipped_{name}: {reason}")
            continue
        ok = time_workload(WORKLOADS[name], args.steps) and ok
        sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
