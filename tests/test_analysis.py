"""Wilson intervals against scipy's, and alpha_j bookkeeping from an accept histogram."""

import numpy as np
import pytest
from scipy.stats import binomtest

from qwen_mtp.decoding.stats import GenerateStats, alpha_intervals, wilson


@pytest.mark.parametrize("s,n", [(0, 10), (5, 10), (10, 10), (37, 120), (1, 3)])
def test_wilson_matches_scipy(s, n):
    ci = binomtest(s, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson(s, n)
    assert abs(lo - ci.low) < 1e-4 and abs(hi - ci.high) < 1e-4


def test_alpha_intervals_from_histogram():
    st = GenerateStats(batch=1, prompt_tokens=1, new_tokens=1, prefill_s=1, decode_s=1, k=3, rounds=10,
                       accept_hist=np.array([4, 3, 2, 1]), position_hits=np.array([6, 3, 1]))
    a = alpha_intervals(st)
    assert [(x[3], x[4]) for x in a] == [(6, 10), (3, 6), (1, 3)]
    np.testing.assert_allclose([x[0] for x in a], st.alpha)
    assert all(x[1] <= x[0] <= x[2] for x in a)
