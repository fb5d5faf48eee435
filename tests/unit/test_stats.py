"""Intervals and the verdict they give (arithlib.core.stats)."""

from __future__ import annotations

import numpy as np
import pytest

import arithlib.core.stats as S


def test_binomial_ci_is_the_exact_clopper_pearson_interval():
    ci = S.binomial_ci(5, 10)
    assert ci.estimate == 0.5 and ci.method == "binomial"
    assert ci.low == pytest.approx(0.187086, abs=1e-5) and ci.high == pytest.approx(0.812914, abs=1e-5)
    assert S.binomial_ci(0, 20).low == 0.0 and S.binomial_ci(20, 20).high == 1.0
    assert S.accuracy_ci([True, False] * 5).estimate == 0.5


def test_bootstrap_is_seeded_paired_and_stratified():
    rng = np.random.default_rng(0)
    x = rng.normal(size=200)
    a = S.bootstrap_ci(lambda v: float(v.mean()), x)
    assert a == S.bootstrap_ci(lambda v: float(v.mean()), x)  # same tables, same interval
    assert a.low < x.mean() < a.high and a.half_width == pytest.approx(1.96 / np.sqrt(200), rel=0.2)
    # paired: the difference of two identical columns has no spread at all
    d = S.bootstrap_ci(lambda u, v: float((u - v).mean()), x, x + 1.0)
    assert d.low == pytest.approx(-1.0) and d.high == pytest.approx(-1.0)
    # stratified: every resample keeps both groups, so a per-group statistic is always defined
    g = np.array(["a"] * 199 + ["b"])
    s = S.bootstrap_ci(lambda grp: float((grp == "b").sum()), g, groups=g)
    assert s.low == s.high == 1.0
    with pytest.raises(ValueError, match="different lengths"):
        S.bootstrap_ci(lambda u, v: 0.0, x, x[:5])


@pytest.mark.parametrize(
    "low, high, verdict",
    [
        (0.30, 0.40, S.REPRODUCED),
        (0.06, 0.20, S.PARTLY),
        (0.00, 0.04, S.NOT_REPRODUCED),
        (0.20, 0.40, S.INCONCLUSIVE),
        (0.02, 0.10, S.INCONCLUSIVE),
        (0.0, 0.5, S.INCONCLUSIVE),
        (float("nan"), float("nan"), S.INCONCLUSIVE),
    ],
)
def test_interval_verdict_gives_a_band_only_when_the_whole_interval_lies_in_it(low, high, verdict):
    assert S.interval_verdict(S.Interval(0.0, low, high, 10, "bootstrap"), 0.27, 0.05) == verdict


def test_interval_verdict_for_rules_where_lower_is_better():
    ci = S.Interval(0.02, 0.01, 0.03, 10, "bootstrap")  # e.g. a decrease that must stay small
    assert S.interval_verdict(ci, 0.05, 0.10, higher_is_better=False) == S.REPRODUCED


def test_sample_size_for_a_half_width():
    n = S.n_for_half_width(0.5, 0.1)
    assert 90 <= n <= 100
    assert S.binomial_ci(n // 2, n).half_width == pytest.approx(0.1, abs=0.01)


def test_crossed_bootstrap_ci_carries_the_spread_across_random_draws():
    from arithlib.core.stats import crossed_bootstrap_ci

    rng = np.random.default_rng(0)
    same = np.tile(rng.random((200, 1)) < 0.5, (1, 10)).astype(float)  # every draw alike
    differ = same.copy()
    differ[:, 5:] = 1.0  # half the draws differ
    a = crossed_bootstrap_ci(lambda d: d.mean(), replicates=same)
    b = crossed_bootstrap_ci(lambda d: d.mean(), replicates=differ)
    assert a.method == b.method == "crossed bootstrap" and a.n == b.n == 200
    assert a.low <= a.estimate <= a.high and b.high - b.low > a.high - a.low
    paired = crossed_bootstrap_ci(lambda h, d: d.mean() - h.mean(), same[:, 0], replicates=same)
    assert paired.estimate == 0 and paired.low == paired.high == 0  # paired on the prompts
    with pytest.raises(ValueError, match="prompts"):
        crossed_bootstrap_ci(lambda d: d.mean(), replicates=same[:, 0])


def test_crossed_bootstrap_resamples_rows_and_seeds():
    """A random control's seed-to-seed spread widens the interval; rows alone do not."""
    rows = np.ones(30)
    same = np.ones((30, 10))
    spread = np.tile(np.array([0.0, 2.0] * 5), (30, 1))  # same mean over seeds, seeds disagree
    stat = lambda a, x: float(x.mean() - a.mean())  # noqa: E731
    tight = S.crossed_bootstrap_ci(stat, rows, replicates=same)
    wide = S.crossed_bootstrap_ci(stat, rows, replicates=spread)
    assert tight.estimate == wide.estimate == 0.0 and tight.low == tight.high == 0.0
    assert wide.low < -0.3 and wide.high > 0.3 and wide.n == 30 and wide.method == "crossed bootstrap"
    assert S.bootstrap_ci(lambda x: float(x.mean()), spread).half_width == 0.0  # rows only: no spread at all
    with pytest.raises(ValueError):
        S.crossed_bootstrap_ci(stat, np.ones(3), replicates=same)


def test_prompts_to_decide_scales_the_side_towards_the_threshold():
    ci = S.Interval(0.30, 0.20, 0.40, 100, "bootstrap")
    assert S.prompts_to_decide(ci, [0.25]) == 400  # (0.10 / 0.05)^2 x 100
    assert S.prompts_to_decide(ci, [0.35, 0.25]) == 400  # the farther-reaching side decides both
    assert S.prompts_to_decide(ci, [0.5]) == 100  # no threshold inside: already decided
    assert S.prompts_to_decide(S.Interval(0.30, 0.10, 0.32, 50, "bootstrap"), [0.31]) == 200  # upper side 0.02 / 0.01
    assert S.prompts_to_decide(ci, [0.30]) is None  # the estimate on the threshold
    assert S.prompts_to_decide(S.Interval(0.3, float("nan"), 0.4, 10, "none"), [0.35]) is None
