"""Exact percentiles of |d|: numpy's linear method, bit for bit, whatever the diffs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.divergence.statistics import scalar_metrics
from loops_callbacks.divergence.statistics import MAIN
from loops_callbacks.divergence.statistics import HostDivergence
from tests.oracle import percentiles_pure_python

finite = st.floats(-1e6, 1e6, allow_nan=False)
PERCENTILES = ("diff_abs_p50", "diff_abs_p90", "diff_abs_p99")


def _percentiles(diffs: np.ndarray) -> list[float]:
    """The step's logged percentiles of |d| when its kept diffs are ``diffs``."""
    totals = {s.name: 0.0 for s in MAIN if not s.shape and s.reduction == "sum"}
    totals |= {"n_action_tokens": float(diffs.size), "n_datums": 1.0, "n_datums_with_actions": 1.0}
    extrema = {s.name: 0.0 for s in MAIN if not s.shape and s.reduction != "sum"}
    metrics = scalar_metrics(HostDivergence(totals, extrema, diffs=diffs), prefix="")
    return [metrics[name] for name in PERCENTILES]


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.one_of(finite, st.sampled_from([0.0, 1.0, -1.0, 2.5])), min_size=1, max_size=300))
def test_equal_to_numpy_percentile_bit_for_bit(values: list[float]) -> None:
    diffs = np.array(values)
    want = np.percentile(np.abs(diffs), [50, 90, 99]).tolist()
    assert _percentiles(diffs) == want
    assert percentiles_pure_python(np.abs(diffs).tolist(), [50, 90, 99]) == want  # the benchmark's reference


def test_large_array_and_input_untouched() -> None:
    diffs = np.random.default_rng(0).normal(size=100_001)
    before = diffs.copy()
    assert _percentiles(diffs) == np.percentile(np.abs(diffs), [50, 90, 99]).tolist()
    assert np.array_equal(diffs, before)
