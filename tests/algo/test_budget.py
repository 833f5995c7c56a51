import pytest

from anytime.algo.budget import (
    anytime_score,
    area_under_curve,
    even_grid,
    every_grid,
    parse_grid,
    prior_probs,
    validate_grid,
)

pytestmark = pytest.mark.unit


def test_even_grid_matches_paper():
    assert even_grid(8000, 4) == [2000, 4000, 6000, 8000]
    assert even_grid(16000, 8) == [2000 * j for j in range(1, 9)]


def test_every_grid_and_parse():
    assert every_grid(250, 1000) == [250, 500, 750, 1000]
    assert len(parse_grid("250:8000:250")) == 32
    assert parse_grid("100,200,400") == [100, 200, 400]
    assert parse_grid([1, 5]) == [1, 5]
    with pytest.raises(ValueError, match="strictly increasing"):
        parse_grid([5, 5])
    with pytest.raises(ValueError, match="START:STOP:STEP"):
        parse_grid("1:2")
    with pytest.raises(ValueError, match="budgets ends at 9000, above max_thinking = 8000"):
        validate_grid([100, 9000], max_thinking=8000)
    with pytest.raises(ValueError, match="`eval.budgets` is empty"):
        validate_grid([], name="`eval.budgets`")


def test_priors():
    grid = [2000, 4000, 6000, 8000]
    assert prior_probs("base", grid) == [0, 0, 0, 1]
    assert prior_probs("uniform", grid) == [0.25] * 4
    assert prior_probs("linear", grid) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert prior_probs("explicit", grid, [0.5, 0.5, 0, 0]) == [0.5, 0.5, 0, 0]
    with pytest.raises(ValueError, match="sum to 1"):
        prior_probs("explicit", grid, [0.5, 0.6, 0, 0])
    with pytest.raises(ValueError, match="non-negative"):
        prior_probs("explicit", grid, [1.5, -0.5, 0, 0])
    with pytest.raises(ValueError, match="must be one of"):
        prior_probs("cubic", grid)


def test_anytime_score_and_auc():
    acc = [0.2, 0.4, 0.6, 0.8]
    assert anytime_score(acc) == pytest.approx(0.5)
    assert anytime_score(acc, [0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.02 + 0.08 + 0.18 + 0.32)
    assert anytime_score(acc, [0, 0, 0, 1]) == pytest.approx(0.8)
    # Even grid: the step-curve area equals the uniform-prior anytime score.
    assert area_under_curve([2000, 4000, 6000, 8000], acc) == pytest.approx(0.5)
    assert area_under_curve([1000, 4000], [0.5, 1.0]) == pytest.approx((0.5 * 1000 + 3000) / 4000)
