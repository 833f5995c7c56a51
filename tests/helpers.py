"""Helpers shared by the trainer-level tests: the quickstart recipe, tiny-run overrides, metrics, and
the models the suite builds once and keeps on disk."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")
# Built models, one folder per hash of what built them; a fresh clone starts empty (ANYTIME_TEST_CACHE moves it).
CACHE = Path(os.environ.get("ANYTIME_TEST_CACHE", REPO / ".cache" / "tests"))
# What a tiny run's model is built from: the quickstart's tiny architecture at tiny_overrides' sizes,
# exactly as `anytime train` would build it at `model.path` (anytime.trainer.launch.prepare_model).
TINY_RUN_MODEL = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, seed=0)


def tiny_overrides(out: Path, steps: int = 3) -> list[str]:
    """A few-step quickstart run in `out`, its model at `out.parent / "init"` (copied from the cache:
    building it takes seconds, copying it milliseconds)."""
    init = out.parent / "init"
    if not init.exists():
        shutil.copytree(tiny_run_model(), init)
    return [f"trainer.output_dir={out}", f"model.path={init}", "model.tiny_hidden_size=64",
            "model.tiny_layers=1", "sft.steps=0", f"trainer.steps={steps}", "trainer.save_every=1",
            "rollout.prompts_per_step=2", "rollout.n=2", "summary.n=2", "budget.budgets=[8,16]",
            "budget.max_thinking=16", "eval.limit=4", "logging.progress=false", "trainer.num_threads=1",
            "learner.deterministic=true", "algorithm.entropy_coef=0.01", "logging.tensorboard=false"]


def read_metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows if "train/rows" in r}


def tiny_run_model() -> Path:
    """The model every tiny run starts from (see TINY_RUN_MODEL)."""
    return cached_tiny_model("tiny-run", corpus_size=2000, **TINY_RUN_MODEL)


def cached_tiny_model(name: str, corpus_size: int, **arch: int) -> Path:
    """A tiny model (anytime.models.tiny.build_tiny_model) whose tokenizer is trained on `corpus_size`
    rows of the synthetic task's text, built once and kept in the cache."""
    def build(out: Path) -> None:
        from anytime.tasks import synthetic
        from anytime.models.tiny import build_tiny_model

        build_tiny_model(out, synthetic.corpus(corpus_size), **arch)

    return cached_model(name, {"corpus": corpus_size, **arch}, build,
                        sources=("anytime/models/tiny.py", "anytime/tasks/synthetic.py"))


def cached_model(name: str, recipe: object, build: Callable[[Path], None], sources: tuple[str, ...]) -> Path:
    """The folder `build(folder)` writes, built once and kept under CACHE by the hash of `recipe`, the
    `sources` (paths under the repository) and the versions of the libraries that shape it. Safe
    under pytest-xdist: a folder appears whole (built aside, then renamed) or not at all."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
    for source in sources:
        digest.update((REPO / source).read_bytes())
    for package in ("torch", "transformers", "tokenizers"):
        digest.update(importlib.metadata.version(package).encode())
    final = CACHE / f"{name}-{digest.hexdigest()[:16]}"
    if not final.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
        try:
            build(scratch / "model")
            try:
                os.rename(scratch / "model", final)
            except OSError:   # another process finished it first
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return final


def kill_and_clean(pid: int) -> None:
    """SIGKILL a process as the OOM killer would, then remove the multiprocessing folders (`pymp-*`)
    that it and its children held: a killed process cannot (for the processes it watches, the
    watchdog does the same). Also those made during its life that no live process holds a socket in
    any more: a process killed while it started a forkserver has bound the socket but not yet
    handed it on, so no process showed it."""
    import psutil

    from anytime.core.watchdog import multiprocessing_folders

    proc = psutil.Process(pid)
    born = proc.create_time()
    folders = multiprocessing_folders([proc, *proc.children(recursive=True)])
    proc.kill()
    deadline = time.monotonic() + 10   # dead, but not reaped: its parent still reads its exit code
    try:
        while time.monotonic() < deadline and proc.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
    except psutil.NoSuchProcess:   # reaped already
        pass
    for folder in folders | _orphaned_multiprocessing_folders(since=born):
        shutil.rmtree(folder, ignore_errors=True)


def still_running_after(pids: list[int], seconds: float, zombies_are_gone: bool = False) -> list[int]:
    """Those of `pids` that still exist after waiting up to `seconds` for all of them to go; with
    `zombies_are_gone`, a process dead but not yet reaped counts as gone."""
    import psutil

    def running(pid: int) -> bool:
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            return False
        return not (zombies_are_gone and status == psutil.STATUS_ZOMBIE)

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if running(p)]


def _orphaned_multiprocessing_folders(since: float) -> set[str]:
    """`pymp-*` folders made after `since` that hold sockets no live process has open."""
    import psutil

    held = {os.path.dirname(c.laddr) for c in psutil.net_connections(kind="unix") if isinstance(c.laddr, str)}
    orphans = set()
    for folder in Path(tempfile.gettempdir()).glob("pymp-*"):
        try:
            sockets = [p for p in folder.iterdir() if p.is_socket()]
            if sockets and folder.stat().st_mtime >= since and str(folder) not in held:
                orphans.add(str(folder))
        except OSError:   # removed meanwhile
            continue
    return orphans


def written_here_or_orphaned(paths: set[str]) -> set[str]:
    """The paths (weight files, /dev/shm entries) written by this process or its children, or by a
    writer that is gone (a leak); a path whose name carries the pid of a live process outside this
    process tree is another test's, running beside this one under pytest-xdist. Names without a
    pid count as ours."""
    import psutil

    from tests.tiers import SHM_WRITER_PID

    me = psutil.Process()
    ours = {me.pid} | {p.pid for p in me.children(recursive=True)}
    writers = {path: SHM_WRITER_PID.match(os.path.basename(path)) for path in paths}
    return {path for path, m in writers.items()
            if m is None or int(m[1]) in ours or not psutil.pid_exists(int(m[1]))}


def placed(recipe: object, cls: type, model_path: str, tokenizer: object, learner: object) -> object:
    """A placement (`RayRollouts`, `ProcessRollouts`, ...) of `recipe` built as the trainer builds it, with
    the recipe's placement plan on this machine."""
    from anytime.config.placement_plan import placement_plan

    return cls(recipe, placement_plan(recipe), model_path, tokenizer, learner)


def snapshot(learner: object, version: int = 0) -> object:
    """A learner's full weights as the trainer hands them to a placement (`Rollouts.sync_weights`)."""
    from anytime.batch.weight_snapshot import WeightSnapshot

    return WeightSnapshot(version, state=learner.full_state_dict())


def train_rows(rollout: object, thinking: object, summary: object, *, summary_max_tokens: int,
               thinking_weight: float = 1.0, summary_weight: float = 1.0, **kwargs: object) -> object:
    """`build_train_batch` of per-group advantages ([B, G, S] thinking, [B, G, S, A] summary), spread over
    the tokens and with the loss width the experience stage gives them (`anytime.trainer.experience`)."""
    from anytime.batch.packing import build_train_batch
    from anytime.trainer.experience import loss_width, token_advantages

    tokens, summaries = token_advantages(rollout, thinking, summary, thinking_weight=thinking_weight,
                                         summary_weight=summary_weight)
    return build_train_batch(rollout, tokens, summaries, max_len=loss_width(rollout, summary_max_tokens), **kwargs)
