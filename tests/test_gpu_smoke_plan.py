"""benchmarks/gpu_smoke.py's plan, checked without a GPU: the runs most likely to hang go first, every
workload of the gpu tier is in the order once, a budget cuts the plan where the worst case says, and
`--plan` prints the same every time. Also that each run is a recipe that loads and names a test that
exists, and that the docs list the order, so a typo is found here rather than in a GPU machine's few
minutes."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.gpu.workloads import PAPER, PROBES, WORKLOADS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
RISKIEST = ["pipeline_zbh1_nccl", "colocated_vllm_sleep_two_ranks", "asyncllm_ipc", "serve_at_budget",
            "lora_vllm_adapter"]


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "benchmarks" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_the_order_starts_with_the_runs_most_likely_to_hang_and_holds_every_run_once(smoke):
    names = [item.name for item in smoke.smoke_items()]
    assert names[:len(RISKIEST)] == RISKIEST
    assert sorted(names) == sorted([*WORKLOADS, *PROBES, smoke.TIER])
    assert list(smoke.ORDER) == names, "every run is named in ORDER, where its place is explained"
    assert names[-1] == smoke.TIER


def test_a_short_budget_cuts_the_first_run_and_leaves_the_rest_for_if_time_is_left(smoke):
    planned = smoke.plan(200, gpus=2)
    first, rest = planned[0], planned[1:]
    assert first.item.name == RISKIEST[0] and first.start_s == 0
    assert first.timeout_s == 200 - smoke.STOP_MARGIN_S and first.verdict == f"cut to {first.timeout_s} s"
    assert {p.verdict for p in rest} == {"budget"}


def test_a_budget_shorter_than_half_of_every_limit_starts_nothing(smoke):
    assert {p.verdict for p in smoke.plan(100, gpus=2)} == {"budget"}


@pytest.mark.parametrize("budget_s", [100, 300, 540, 900, 3600])
@pytest.mark.parametrize("gpus", [1, 2])
def test_every_planned_run_ends_inside_the_budget_even_in_the_worst_case(smoke, budget_s, gpus):
    planned = smoke.plan(budget_s, gpus)
    runs = [p for p in planned if p.timeout_s is not None]
    assert runs or budget_s < 300, "a budget of minutes fits at least the first run"
    for p in runs:
        assert smoke.SHORTEST_SHARE * p.item.limit_s <= p.timeout_s <= p.item.limit_s and p.item.gpus <= gpus
        assert p.start_s + p.timeout_s + smoke.STOP_MARGIN_S <= budget_s, p
    starts = [p.start_s for p in runs]
    assert starts == sorted(starts)


def test_one_gpu_skips_the_two_gpu_runs_at_no_cost(smoke):
    planned = {p.item.name: p for p in smoke.plan(540, gpus=1)}
    assert planned["pipeline_zbh1_nccl"].verdict == "needs 2 GPUs"
    assert planned["colocated_vllm_sleep_two_ranks"].verdict == "needs 2 GPUs"
    assert planned["asyncllm_ipc"].start_s == 0 and planned["asyncllm_ipc"].verdict == "runs"


def test_without_a_budget_every_run_gets_its_own_limit(smoke):
    assert all(p.timeout_s == p.item.limit_s for p in smoke.plan(None, gpus=2))


def test_the_plan_prints_the_same_every_time_and_starts_nothing(smoke, capsys):
    outputs = []
    for _ in range(2):
        assert smoke.main(["--plan", "--budget-s", "540"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    rows = [line.split()[1] for line in outputs[0].splitlines()[2:] if line[:2].strip().isdigit()]
    assert rows == [item.name for item in smoke.smoke_items()]
    assert "limit_s" in outputs[0] and "needs" in outputs[0] and "checks:" in outputs[0]


def test_every_workload_is_a_recipe_that_loads(tmp_path):
    from anytime.config import load_recipe

    for workload in WORKLOADS.values():
        load_recipe(workload.recipe, workload.arguments(tmp_path / "run", workload.steps,
                                                        None if workload.recipe == PAPER else tmp_path / "model"))


def test_every_run_names_a_gpu_test_that_exists():
    for item in [*WORKLOADS.values(), *PROBES.values()]:
        file, name = item.test.split("::")
        tree = ast.parse((REPO / file).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name.split("[")[0] in functions, f"{item.name}: no test {item.test}"
        assert "pytest.mark.gpu" in (REPO / file).read_text(), f"{file} is not in the gpu tier"


def test_docs_list_the_smoke_order(smoke):
    """docs/distributed.md numbers the runs as the smoke orders them (its table refers to the numbers)."""
    docs = (REPO / "docs" / "distributed.md").read_text()
    section = docs.split("## On GPUs: what is tested where")[1].split("\n## ")[0]
    listed = re.findall(r"^\d+\. `([a-z0-9_]+)`", section, re.M)
    assert listed == list(smoke.ORDER)
