"""Docs that cannot rot: every shell block in README.md and docs/ is run here in a short form, run by a
named test, run by .ci/run, or marked as needing a GPU, a cluster or an optional extra; every link
between the docs resolves; docs/recipes.md is the reference generated from the schema; and the
README's "train your own model" path runs end to end on a tiny model.

A block is marked by the comment line right above it: `<!-- check: KIND -->` with KIND one of
`ci`, `short`, `own-model`, `gpu`, `cluster`, `extra:NAME` or `test:PATH::NAME`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- check: (?P<check>[^>]+?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
# Appended to a documented `python benchmarks/X.py ...`: the same script on a size that takes seconds.
BENCHMARK_SHORT = {
    "reward_golds.py": ["--data", "tests/fixtures/math", "--workers", "1"],
    "reward.py": ["--items", "20", "--rounds", "1"],
    "rollout.py": ["--engines", "hf", "--workloads", "fixed", "--prompts", "2", "--traces", "2", "--think", "32",
                   "--budgets", "16,32", "--summaries", "1", "--summary-tokens", "4", "--repeats", "1"],
    "rollout_workers.py": ["--placements", "colocated", "--prompts", "2", "--traces", "2", "--summaries", "1",
                           "--budgets", "16,32", "--rounds", "1"],
    "weight_sync.py": ["--repeats", "1"],
    "learner_packing.py": ["--settings", "quickstart", "--repeats", "1", "--skip-logprob"],
    "pipeline.py": ["--hidden", "64", "--rows", "8", "--layers", "4", "--microbatches", "4", "--rounds", "1",
                    "--warmup", "0", "--split-reps", "2", "--ranks", "2", "--no-deepspeed"],
    "schedules.py": ["--quick"],
    "precision.py": ["--hidden", "64", "--layers", "1", "--vocab", "256"],
    "lora.py": ["--rows", "1", "--tokens", "16", "--reps", "1"],
    "async_rl.py": ["--steps", "2", "--skip", "1", "--warm-steps", "2", "--prompts", "2"],
}


def blocks(path: Path) -> list[tuple[str | None, str, str]]:
    """(check, language, body) of every fenced block of a markdown file."""
    return [(m["check"], m["lang"], m["body"]) for m in BLOCK.finditer(path.read_text())]


def commands(body: str) -> list[str]:
    """The shell commands of a block, continuation lines joined, comments dropped."""
    joined = body.replace("\\\n", " ")
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def shell_blocks() -> list[tuple[Path, str | None, str]]:
    return [(path, check, body) for path in DOCS for check, lang, body in blocks(path) if lang in ("bash", "sh")]


@pytest.mark.unit
def test_every_shell_block_is_checked_or_marked():
    allowed = ("ci", "short", "own-model", "gpu", "cluster")
    for path, check, body in shell_blocks():
        where = f"{path.relative_to(REPO)}: {body.strip().splitlines()[0]}"
        assert check is not None, f"{where}: mark the block (<!-- check: ... -->) or give it a short form"
        assert check in allowed or check.startswith(("extra:", "test:")), f"{where}: unknown check {check!r}"
        if check.startswith("test:"):
            file, name = check[5:].split("::")
            tree = ast.parse((REPO / file).read_text())
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{where}: no {check}"
        if check == "ci":
            ci = (REPO / ".ci" / "run").read_text()
            for command in commands(body):
                setup = command.split(" && anytime train")[0]   # .ci/run installs; the quickstart run is no test
                assert setup in ci, f"{where}: .ci/run does not run {setup!r}"


@pytest.mark.unit
def test_the_readmes_gpu_install_brings_what_the_gpu_tier_runs_with():
    """`python -m pytest -m gpu` right after the README's GPU install: the extras it names bring pytest,
    the plugins the suite's markers need (`timeout`) and the libraries the gpu workloads run on."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = next(body for check, _, body in blocks(REPO / "README.md") if check == "gpu" and "pip install" in body)
    named = re.search(r'pip install -e "\.\[([^\]]+)\]"', install)[1].split(",")
    brought = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for name in named
               for requirement in extras[name]}
    for needed in ("pytest", "pytest-timeout", "pytest-xdist", "vllm", "deepspeed", "peft", "ray"):
        assert needed in brought, f"the README's GPU install (extras {named}) brings no {needed}"


@pytest.mark.unit
def test_links_between_docs_resolve():
    for path in [*DOCS, REPO / "eval" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.relative_to(REPO)} links to missing {target}"
            if anchor and dest.suffix == ".md":
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                assert anchor in slugs, f"{path.relative_to(REPO)} links to missing heading {target}"


@pytest.mark.unit
def test_recipe_reference_is_current_and_complete():
    """docs/recipes.md is `anytime config --reference`, and it names every field of the schema."""
    from anytime.config import recipe_reference, schema_keys

    text = (REPO / "docs" / "recipes.md").read_text()
    assert text == recipe_reference(), "docs/recipes.md is stale: run `anytime config --reference > docs/recipes.md`"
    for key in schema_keys():
        assert f"`{key}`" in text, f"{key} is missing from docs/recipes.md"


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (f"{' '.join(argv)} failed ({out.returncode}):\n"
                                 f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def _short_form(command: str, tmp: Path) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "anytime":
        return [sys.executable, "-m", "anytime.cli", *argv[1:]]
    if argv[:2] == ["python", argv[1]] and argv[1].startswith("benchmarks/"):
        script = Path(argv[1]).name
        extra = BENCHMARK_SHORT[script]
        if script == "weight_sync.py":   # a tiny model instead of SmolLM2's shape
            extra = extra + ["--model", str(_tiny_model(tmp))]
        return [sys.executable, str(REPO / argv[1]), *argv[2:], *extra]
    raise AssertionError(f"no short form for {command!r}: add one to tests/test_docs.py or mark the block")


def _tiny_model(tmp: Path) -> Path:
    out = tmp / "tiny"
    if not out.exists():
        _run([sys.executable, "-m", "anytime.cli", "tiny-model", str(out)], REPO)
    return out


def short_blocks() -> list:
    return [pytest.param(body, id=f"{path.name}:{commands(body)[0][:40]}")
            for path, check, body in shell_blocks() if check == "short"]


@pytest.mark.e2e
@pytest.mark.parametrize("body", short_blocks())
def test_documented_commands_run_in_short_form(body, tmp_path):
    for command in commands(body):
        _run(_short_form(command, tmp_path), REPO)


@pytest.mark.e2e
def test_doctor_runs_here_without_a_false_alarm():
    out = subprocess.run([sys.executable, "-m", "anytime.cli", "doctor"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert "PROBLEM" not in out.stdout, out.stdout
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.e2e
def test_train_your_own_model_path_runs_end_to_end(tmp_path, tiny_model_dir):
    """The README's recipe and commands, run as written with a tiny local model, a jsonl file of the
    documented format written here, and sizes that fit a test (overrides appended)."""
    readme = (REPO / "README.md").read_text()
    own = [(lang, body) for check, lang, body in blocks(REPO / "README.md") if check == "own-model"]
    recipe = next(body for lang, body in own if lang == "yaml")
    shell = next(body for lang, body in own if lang == "bash")
    row = json.loads(re.search(r"```json\n(.*?)\n```", readme, re.S).group(1))
    rows = [{**row, "problem": f"What is ${a} + {b}$?", "answer": str(a + b)} for a in range(6) for b in range(3)]
    (tmp_path / "my_problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_recipe.yaml").write_text(recipe)
    steps = 2
    short = [f"model.path={tiny_model_dir}", "model.dtype=float32", "rollout.engine=hf", "rollout.n=2",
             "rollout.prompts_per_step=2", "summary.n=1", "summary.max_tokens=8", "budget.max_thinking=16",
             "budget.num_budgets=2", f"trainer.steps={steps}", "trainer.save_every=1", "learner.lr=1e-4",
             "learner.mini_batch_prompts=2", "eval.limit=2", "eval.samples=1",
             f"eval.data_dir={REPO}/tests/fixtures/math",
             "eval.every=0", "logging.progress=false", "logging.tensorboard=false", "trainer.num_threads=1",
             ]
    for command in commands(shell):
        command = command.replace("step_200", f"step_{steps}")
        argv = shlex.split(command)
        if argv[:2] == ["anytime", "train"]:
            argv += short
        elif argv[:2] == ["anytime", "eval"]:
            argv += ["--limit", "2", "--samples", "1", "--data-dir", f"{REPO}/tests/fixtures/math", "--engine", "hf"]
        if argv[0] == "anytime":
            argv = [sys.executable, "-m", "anytime.cli", *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        _run(argv, tmp_path)
    results = json.loads((tmp_path / "runs/mine/eval/results.json").read_text())
    assert list(results["models"]) == [f"runs/mine/checkpoints/step_{steps}"]
    assert (tmp_path / "runs/mine/hf/config.json").is_file()
