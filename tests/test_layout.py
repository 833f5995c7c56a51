"""The package's shape, checked from its source: no import circle among its modules (imports inside
functions count; `if TYPE_CHECKING:` imports, which never run, do not) nor among its packages and
top-level modules (type-checking imports count too: the layers stand one above the other), the
recipe below every package that reads it, at most 9 modules directly in `anytime/`, none over 500
lines, every registry entry importable, `tests/` mirroring the package tree, and `anytime.analysis`
(simulators, plots, `anytime schedule`) above the runtime: no runtime module imports it and a training
run does not load it."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "anytime"
ANALYSIS = "anytime.analysis"
# The entry point, which may import `anytime.analysis` inside its functions (the `anytime schedule`
# subcommand and its parser), never when it is imported.
LAZY_ANALYSIS_IMPORTERS = {"anytime.cli"}
# What a training run imports: the loop, its launcher and warm start, and the in-package engine,
# placements and learners (the pipeline schedules are added from their registry).
TRAINING_MODULES = ("anytime.trainer.trainer", "anytime.trainer.launch", "anytime.trainer.sft", "anytime.rollout.engines.hf",
                    "anytime.rollout.workers.local", "anytime.learner.data_parallel", "anytime.learner.pipeline_learner")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, type_checking: bool = False) -> set[str]:
    """Every module this source imports at run time (at any depth, functions included), and with
    `type_checking` also those under `if TYPE_CHECKING:`."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _on_import(tree: ast.AST) -> ast.AST:
    """The part of a source that runs when it is imported: function bodies left out (class bodies
    run, so they stay; their methods go)."""

    class Strip(ast.NodeTransformer):
        def visit_FunctionDef(self, node: ast.AST) -> None:
            return None

        visit_AsyncFunctionDef = visit_FunctionDef

    return Strip().visit(tree)


def _in_analysis(module: str) -> bool:
    return module == ANALYSIS or module.startswith(ANALYSIS + ".")


def analysis_importers() -> dict[str, list[str]]:
    """Runtime module -> the `anytime.analysis` modules it imports: at any depth and for type checking
    too, except that the lazy importers (the CLI) are judged only on what runs when they are imported."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if _in_analysis(module):
            continue
        tree = ast.parse(path.read_text())
        if module in LAZY_ANALYSIS_IMPORTERS:
            tree = _on_import(tree)
        if deps := sorted(d for d in _imports(tree, module, path.name == "__init__.py", True) if _in_analysis(d)):
            found[module] = deps
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the `anytime` modules it imports (a module imports its package's `__init__` too)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        deps = {d for d in _imports(tree, name, path.name == "__init__.py", type_checking) if d in files}
        graph[name] = deps - {name}
    return graph


def unit_of(module: str) -> str:
    """The package or top-level module a module belongs to: `anytime.rollout.engines.hf` -> `anytime.rollout`."""
    parts = module.split(".")
    return ".".join(parts[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.unit
def test_no_import_circle_among_modules():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


@pytest.mark.unit
@pytest.mark.parametrize("type_checking", [False, True], ids=["run-time", "type-checking-too"])
def test_no_import_circle_among_packages(type_checking):
    """No package imports upward into one that imports it, counting the imports made only for type
    checking too: the layers stand one above the other (the recipe below all that read it)."""
    units: dict[str, set[str]] = {}
    for module, deps in import_graph(type_checking).items():
        units.setdefault(unit_of(module), set()).update(unit_of(d) for d in deps if unit_of(d) != unit_of(module))
    units.pop("anytime", None)   # the root package's __init__ holds only the version
    for deps in units.values():
        deps.discard("anytime")
    cycle = find_cycle(units)
    assert cycle is None, "package import circle: " + " -> ".join(cycle or [])


@pytest.mark.unit
def test_the_checker_sees_a_circle_and_ignores_type_checking_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from anytime.config import Recipe\n"
              "def f():\n    from anytime.rollout import runner\n")
    found = _imports(ast.parse(source), "anytime.learner.x", False)
    assert "anytime.rollout.runner" in found and "anytime.config" not in found
    assert "anytime.config" in _imports(ast.parse(source), "anytime.learner.x", False, type_checking=True)


@pytest.mark.unit
def test_the_recipe_imports_nothing_that_reads_it():
    """`anytime.config` sits below the packages it configures: no module of it imports theirs, not even for
    type checking or inside a function; the names it checks come from `anytime.components`."""
    graph = import_graph(type_checking=True)
    above = ("anytime.rollout", "anytime.learner", "anytime.trainer", "anytime.evaluation", "anytime.serving")
    config = {d for m, deps in graph.items() if unit_of(m) == "anytime.config" for d in deps}
    assert not {d for d in config if unit_of(d) in above}, sorted(d for d in config if unit_of(d) in above)
    assert "anytime.components" in config


@pytest.mark.unit
def test_no_runtime_module_imports_analysis():
    """`anytime.analysis` (the step-timeline and pipeline-schedule simulators, their plots, `anytime
    schedule`) imports the runtime, never the reverse: no module outside it imports it, not inside a
    function nor for type checking, and no registry names it; the CLI may only inside its functions."""
    assert (PACKAGE / "analysis" / "__init__.py").is_file()
    assert not analysis_importers(), f"runtime modules importing {ANALYSIS}: {analysis_importers()}"
    named = {f"{r.key}: {name}" for r in _registries() for name in r.names() if _in_analysis(_home(r, name))}
    assert not named, f"registry entries in {ANALYSIS} (a training run would import them): {sorted(named)}"


@pytest.mark.unit
def test_the_analysis_rule_sees_what_runs_on_import():
    source = ("import anytime.analysis.timeline\nclass C:\n    from anytime.analysis import schedule_sim\n"
              "    def f(self):\n        from anytime.analysis import schedule_plot\n"
              "def g():\n    from anytime.analysis import schedule_command\n")
    every = _imports(ast.parse(source), "anytime.cli", False)
    on_import = _imports(_on_import(ast.parse(source)), "anytime.cli", False)
    assert {"anytime.analysis.schedule_plot", "anytime.analysis.schedule_command"} <= every
    assert {d for d in on_import if _in_analysis(d)} == {"anytime.analysis.timeline", "anytime.analysis",
                                                         "anytime.analysis.schedule_sim"}


@pytest.mark.integration
def test_a_training_run_does_not_load_analysis():
    """In a fresh interpreter, the training modules, every pipeline schedule and the command line of
    `anytime train` load no `anytime.analysis` module (what the static rule above cannot see: imports
    by name)."""
    code = ("import importlib, sys\n"
            f"for name in {TRAINING_MODULES!r}:\n    importlib.import_module(name)\n"
            "from anytime.pipeline import SCHEDULES\n"
            "for name in SCHEDULES:\n    SCHEDULES.get(name)\n"
            "from anytime.cli import build_parser\n"
            "build_parser('train').parse_args(['train', 'recipes/quickstart.yaml'])\n"
            "print(*sorted(m for m in sys.modules if m.startswith('anytime.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.split()
    assert set(TRAINING_MODULES) <= set(loaded) and "anytime.pipeline.auto" in loaded
    assert not [m for m in loaded if _in_analysis(m)], f"a training run loads {[m for m in loaded if _in_analysis(m)]}"


@pytest.mark.unit
def test_top_level_is_small_and_modules_fit_in_a_head():
    top = [p.name for p in PACKAGE.glob("*.py")]
    # the entry points (cli, doctor), the defaults, the runtime registries (components), errors, registry
    assert len(top) <= 7, f"{len(top)} modules directly in anytime/: {sorted(top)}"
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"
    recipe_lines = len((PACKAGE / "config" / "recipe.py").read_text().splitlines())
    assert recipe_lines < 450, f"anytime/config/recipe.py has {recipe_lines} lines: the recipe schema should stay readable"


@pytest.mark.unit
def test_functions_fit_on_a_screen():
    """No function in the package is longer than 80 lines (decorators aside): a longer one is split
    where its steps are."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"functions over 80 lines: {long}"


# The modules that hold registries: the method's, each beside its functions, and the runtime's.
REGISTRY_MODULES = ("anytime.algo", "anytime.algo.advantages", "anytime.algo.budget", "anytime.algo.loss", "anytime.algo.offpolicy",
                    "anytime.components", "anytime.defaults", "anytime.pipeline")


def _registries() -> list:
    from anytime.registry import FunctionRegistry, Registry

    found = []
    for module in REGISTRY_MODULES:
        mod = importlib.import_module(module)
        found += [v for v in vars(mod).values() if isinstance(v, (Registry, FunctionRegistry))]
    return found


def _home(registry, name: str) -> str:
    """The module an entry's implementation lives in (a function's own, or a string entry's)."""
    from anytime.registry import Registry

    return registry.target(name).partition(":")[0] if isinstance(registry, Registry) else registry.get(name).__module__


@pytest.mark.unit
def test_every_registry_entry_imports():
    registries = _registries()
    assert {r.key for r in registries} >= {"algorithm.estimator", "summary.estimator", "algorithm.variance_reduction",
                                           "budget.prior", "algorithm.loss_agg", "algorithm.kl_type", "model.dtype",
                                           "rollout.engine", "rollout.placement", "learner.backend",
                                           "learner.lr_schedule", "learner.pipeline.schedule"}
    for registry in registries:
        for name in registry.names():
            assert registry.get(name) is not None, f"{registry.key}: {name}"


@pytest.mark.unit
def test_recipe_choices_are_the_registries_names():
    """A recipe's allowed values come from the registries: the error lists them, a new entry is allowed."""
    from anytime.algo.advantages import THINKING_ESTIMATORS
    from anytime.config import RecipeError, load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe(None, ["algorithm.estimator=bpro"])
    assert all(repr(name) in str(err.value) for name in THINKING_ESTIMATORS.names())
    assert "did you mean 'brpo'" in str(err.value)
    for name in THINKING_ESTIMATORS.names():
        assert load_recipe(None, [f"algorithm.estimator={name}"]).algorithm.estimator == name


@pytest.mark.unit
def test_tests_mirror_the_package():
    """Every test file sits in the folder of the package it tests (`tests/<package>/`), or at the top
    for what spans packages (the CLI, the layout, golden runs); `tests/gpu/` holds the gpu tier's
    whole runs, which span packages too."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))} - {"gpu"}
    assert folders <= packages, f"test folders with no package: {sorted(folders - packages)}"
    assert len(folders) >= len(packages) - 1, f"packages without a test folder: {sorted(packages - folders)}"


@pytest.mark.unit
def test_the_rollout_scores_and_the_trainer_makes_the_rows():
    """The method is in the trainer's step: no module of `anytime.rollout` imports the advantage
    estimators, the importance correction, the packer or the row exchange (not inside a function nor
    for type checking); the step's experience stage does, and the step calls it."""
    graph = import_graph(type_checking=True)
    method = {"anytime.algo.advantages", "anytime.algo.offpolicy", "anytime.batch.packing"}
    importers = {m: sorted(deps & (method | {"anytime.trainer.rows"})) for m, deps in graph.items()
                 if unit_of(m) == "anytime.rollout" and deps & (method | {"anytime.trainer.rows"})}
    assert not importers, f"rollout modules importing the method: {importers}"
    assert method <= graph["anytime.trainer.experience"]
    assert {"anytime.trainer.experience", "anytime.trainer.rows"} <= graph["anytime.trainer.trainer"]


@pytest.mark.unit
def test_the_layout_shows_the_architecture():
    """Round 6: the recipe and what is derived from it in `anytime.config`; serving in a package of its
    own; `anytime.rollout` split into engines and workers (the wire format and the device pinning in
    modules of their own), engines below workers; the learner imports neither rollout nor serving."""
    graph = import_graph(type_checking=True)
    modules = set(graph)
    assert {f"anytime.config.{m}" for m in ("recipe", "checks", "schema", "files", "answer_format",
                                            "placement_plan")} <= modules
    assert {f"anytime.serving.{m}" for m in ("protocol", "serve", "answer_processor", "export", "model_card")} <= modules
    assert {f"anytime.rollout.workers.{m}" for m in ("worker", "pool", "placement", "wire", "devices")} <= modules
    assert {f"anytime.rollout.engines.{m}" for m in ("engine", "hf", "vllm.engine")} <= modules
    up = {m: sorted(d for d in deps if d.startswith(("anytime.rollout", "anytime.serving", "anytime.trainer")))
          for m, deps in graph.items() if m.startswith("anytime.learner")}
    assert not {m: d for m, d in up.items() if d}, f"learner modules importing the rollout or serving: {up}"
    up = {m: sorted(d for d in deps if d.startswith(("anytime.serving", "anytime.trainer", "anytime.learner")))
          for m, deps in graph.items() if m.startswith("anytime.rollout")}
    assert not {m: d for m, d in up.items() if d}, f"rollout modules importing above them: {up}"
    up = {m: sorted(d for d in deps if d.startswith(("anytime.rollout.workers", "anytime.rollout.runner",
                                                     "anytime.rollout.settings")))
          for m, deps in graph.items() if m.startswith("anytime.rollout.engines")}
    assert not {m: d for m, d in up.items() if d}, f"engines importing the workers or the runner: {up}"


@pytest.mark.unit
def test_vllm_is_touched_in_two_places_only():
    """vLLM's engines (`anytime.rollout.engines.vllm`) and serving (`anytime.serving`) import it; nothing
    else does, inside a function or not."""
    touch = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                touch.add(_module_name(path))
    outside = sorted(m for m in touch if not m.startswith(("anytime.rollout.engines.vllm", "anytime.serving")))
    assert not outside, f"modules importing vLLM outside its two places: {outside}"
    assert any(m.startswith("anytime.rollout.engines.vllm") for m in touch) and "anytime.serving.answer_processor" in touch
