"""Exact percentiles: numpy's linear method, bit for bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.divergence.metrics import abs_percentiles_linear
from tests.oracle import percentiles_pure_python

finite = st.floats(-1e6, 1e6, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.one_of(finite, st.sampled_from([0.0, 1.0, -1.0, 2.5])), min_size=1, max_size=300))
def test_equal_to_numpy_percentile_bit_for_bit(values: list[float]) -> None:
    diffs = np.array(values)
    want = np.percentile(np.abs(diffs), [50, 90, 99]).tolist()
    assert abs_percentiles_linear(diffs, (50, 90, 99)) == want
    assert percentiles_pure_python(np.abs(diffs).tolist(), [50, 90, 99]) == want  # the benchmark's reference


def test_large_array_and_input_untouched() -> None:
    diffs = np.random.default_rng(0).normal(size=100_001)
    before = diffs.copy()
    assert abs_percentiles_linear(diffs, (50, 90, 99)) == np.percentile(np.abs(diffs), [50, 90, 99]).tolist()
    assert np.array_equal(diffs, before)
