"""The method's registries hold the functions themselves, defined in `anytime.algo`; the names the
recipe schema reads from `anytime.algo` are exactly the ones implemented; a wrong name is answered
with the allowed ones and the closest of them."""

import importlib
import inspect

import pytest
import torch

import anytime.algo
from anytime.algo.advantages import THINKING_ESTIMATORS, brpo_thinking, thinking_advantages
from anytime.errors import RecipeError
from anytime.registry import FunctionRegistry, Names

pytestmark = pytest.mark.unit

# The modules of `anytime.algo` that define registered functions.
IMPLEMENTING_MODULES = ("anytime.algo.advantages", "anytime.algo.budget", "anytime.algo.loss", "anytime.algo.offpolicy")


def function_registries() -> dict[str, FunctionRegistry]:
    found = {}
    for module in IMPLEMENTING_MODULES:
        found.update({v.key: v for v in vars(importlib.import_module(module)).values()
                      if isinstance(v, FunctionRegistry)})
    return found


def test_every_registered_name_is_a_function_defined_in_algo():
    registries = function_registries()
    assert {"algorithm.estimator", "summary.estimator", "algorithm.variance_reduction", "budget.prior",
            "algorithm.loss_agg", "algorithm.kl_type", "algorithm.offpolicy_correction"} <= set(registries)
    for key, registry in registries.items():
        for name in registry.names():
            function = registry.get(name)
            assert inspect.isfunction(function), f"{key}: {name} is {function!r}"
            assert function.__module__.startswith("anytime.algo."), f"{key}: {name} lives in {function.__module__}"
    # go to definition from a call by name lands on the function itself
    assert THINKING_ESTIMATORS.get("brpo") is brpo_thinking


def test_the_declared_names_are_the_implemented_ones():
    """What the recipe schema accepts (the `Names` in `anytime.algo`) is what the modules implement."""
    declared = [v for v in vars(anytime.algo).values() if type(v) is Names]
    assert declared
    registries = function_registries()
    for names in declared:
        assert names.key in registries, f"{names.key} is declared but no module implements it"
        assert registries[names.key].names() == names.names()


def test_an_unknown_name_lists_the_names_and_the_closest():
    with pytest.raises(RecipeError, match=r"`algorithm.estimator` must be one of 'brpo', 'grpo', 'dr_grpo', "
                                          r"'rloo', got 'bpro' \(did you mean 'brpo'\?\)"):
        THINKING_ESTIMATORS.get("bpro")
    with pytest.raises(RecipeError, match="did you mean 'brpo'"):
        thinking_advantages("bpro", torch.zeros(2, 3), [0.0, 0.0, 1.0])
    with pytest.raises(RecipeError, match=r"must be one of .*, got 'ppo'$"):   # nothing close: no hint
        THINKING_ESTIMATORS.get("ppo")


def test_a_name_on_one_side_only_fails_when_the_registry_is_built():
    declared = Names("algorithm.estimator", ("brpo", "mine"))
    with pytest.raises(ValueError, match=r"declared names without a function: \['mine'\]; "
                                         r"functions under undeclared names: \['theirs'\]"):
        declared.implemented_by({"brpo": brpo_thinking, "theirs": brpo_thinking})
    with pytest.raises(ValueError, match="must be a function"):
        FunctionRegistry("budget.prior", {"base": "anytime.algo.budget:base_prior"})
    # the declared order is the registry's, whatever the order the functions are given in
    both = Names("k", ("a", "b")).implemented_by({"b": len, "a": abs})
    assert both.names() == ("a", "b") and both.get("a") is abs
