import math
import statistics

import pytest

from anytime.core.stats import mean_ci, t_quantile_975

pytestmark = pytest.mark.unit


def test_mean_ci_is_the_student_t_interval():
    values = [0.10, 0.14, 0.12, 0.08, 0.16]
    mean, half = mean_ci(values)
    assert mean == pytest.approx(0.12)
    # 4 degrees of freedom: t = 2.776
    assert half == pytest.approx(2.776 * statistics.stdev(values) / math.sqrt(5))
    assert mean_ci([0.3]) == (0.3, 0.0)


def test_untabulated_degrees_of_freedom_take_the_wider_interval_of_the_df_below():
    assert t_quantile_975(11) == t_quantile_975(10) > 2.201 > t_quantile_975(12)  # t(11) = 2.201
    assert t_quantile_975(1000) == t_quantile_975(30) > 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)
    with pytest.raises(ValueError):
        mean_ci([])
