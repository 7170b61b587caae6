"""Statistics of parts (micro-batches, ranks) merge into those of the concatenated batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.divergence.statistics import scalar_metrics
from tests.helpers import assert_metrics_equal, assert_totals_equal, reduce_in_threads, rows, stats_of
from tests.oracle import PREFIX


def split(batch: list[dict[str, Any]], cuts: list[int]) -> list[list[dict[str, Any]]]:
    bounds = sorted({min(c, len(batch)) for c in cuts} | {0, len(batch)})
    return [batch[a:b] for a, b in zip(bounds, bounds[1:])] or [[]]


@settings(max_examples=60, deadline=None)
@given(batch=rows(max_datums=8), cuts=st.lists(st.integers(0, 8), max_size=3), top_n=st.integers(0, 5))
def test_merged_parts_equal_the_whole(batch: list[dict[str, Any]], cuts: list[int], top_n: int) -> None:
    parts = [stats_of(part, top_n) for part in split(batch, cuts)]
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merge(part)
    whole, got = stats_of(batch, top_n).to_host(), merged.to_host()
    assert_metrics_equal(scalar_metrics(got), scalar_metrics(whole))
    assert np.array_equal(got.worst, whole.worst)
    assert np.array_equal(got.diffs, whole.diffs)
    assert_totals_equal(got, whole)


@settings(max_examples=40, deadline=None)
@given(batch=rows(max_datums=8), cuts=st.lists(st.integers(0, 8), min_size=1, max_size=3),
       top_n=st.integers(0, 5), capped=st.booleans())
def test_reduction_across_ranks_equals_the_concatenation(
    batch: list[dict[str, Any]], cuts: list[int], top_n: int, capped: bool
) -> None:
    size = 10_000 if capped else None
    parts = split(batch, cuts)
    if len(parts) == 1:
        parts.append([])  # a rank with nothing at all
    results = reduce_in_threads([stats_of(part, top_n, size) for part in parts])
    whole = stats_of(batch, top_n).to_host()
    for result in results:
        host = result.to_host()
        assert_metrics_equal(scalar_metrics(host), scalar_metrics(whole))
        assert np.array_equal(host.worst, whole.worst)
        assert np.array_equal(host.diffs, whole.diffs)


def test_capped_sample_is_exact_below_the_cap_and_uniform_above() -> None:
    rng = np.random.default_rng(0)
    batch = [
        {"tokens": [0] * 50, "logprobs": (-rng.exponential(size=50)).tolist(), "mask": [1.0] * 50,
         "trainer": (-rng.exponential(size=50)).tolist()}
        for _ in range(40)
    ]
    exact = stats_of(batch, 0).to_host()
    merged = stats_of(batch[:10], 0, sample_size=2000)
    for start in range(10, 40, 10):
        merged = merged.merge(stats_of(batch[start:start + 10], 0, sample_size=2000))
    assert np.array_equal(merged.to_host().diffs, exact.diffs)  # 2000 tokens: all kept, in order

    capped = stats_of(batch[:10], 0, sample_size=600)
    for start in range(10, 40, 10):
        capped = capped.merge(stats_of(batch[start:start + 10], 0, sample_size=600))
    kept = capped.to_host().diffs
    assert kept.shape == (600,)
    assert set(kept.tolist()) <= set(exact.diffs.tolist())
    # every quarter of the batch is represented about equally (uniform over the union)
    which = np.searchsorted(np.cumsum([500] * 4), [exact.diffs.tolist().index(v) for v in kept], side="right")
    assert np.bincount(which, minlength=4).min() > 100
    assert scalar_metrics(capped.to_host())[PREFIX + "diff_abs_p50"] == pytest.approx(
        scalar_metrics(exact)[PREFIX + "diff_abs_p50"], rel=0.2
    )


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 20_000), k=st.integers(1, 30), levels=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_stable_top_k_on_large_inputs_with_ties(n: int, k: int, levels: int, seed: int) -> None:
    """The candidate pre-filter never loses a top value; ties go to the earliest index."""
    from loops_callbacks.divergence.statistics import _stable_top_k

    values = torch.randint(0, levels, (n,), generator=torch.Generator().manual_seed(seed)).double()
    k = min(k, n)
    want = sorted(range(n), key=lambda i: (-values[i].item(), i))[:k]
    assert _stable_top_k(values, k).tolist() == sorted(want)


@settings(max_examples=40, deadline=None)
@given(batch=rows(max_datums=8), chunk=st.integers(1, 12), top_n=st.integers(0, 5), capped=st.booleans())
def test_a_batch_read_in_whole_datum_chunks_equals_the_batch_read_at_once(
    batch: list[dict[str, Any]], chunk: int, top_n: int, capped: bool
) -> None:
    """Large CPU batches are read a few datums at a time (bounded memory); every statistic is the same."""
    from loops_callbacks.divergence import statistics

    size = 5 if capped else None
    whole = stats_of(batch, top_n, size).to_host()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(statistics, "CHUNK_POSITIONS", chunk)
        got = stats_of(batch, top_n, size).to_host()
    assert_metrics_equal(scalar_metrics(got), scalar_metrics(whole))
    assert np.array_equal(got.worst, whole.worst)  # datum indices and token context across chunks
    assert np.array_equal(got.diffs, whole.diffs)  # the same random keys, drawn in the same order
    assert got.extrema == whole.extrema
    assert_totals_equal(got, whole)


def test_a_batch_read_in_one_chunk_keeps_sample_size_diffs_as_a_chunked_read_does() -> None:
    """One chunk was returned uncut: 6 diffs for sample_size 5, where a chunked read of the same batch kept 5."""
    batch = [{"tokens": [0] * 4, "logprobs": [None, -0.5, -0.25, -1.0], "mask": [1.0] * 4,
              "trainer": [None, -0.5, -0.5, -0.5]}] * 2
    assert len(stats_of(batch, 0, 5).to_host().diffs) == 5
    assert len(stats_of(batch, 0, None).to_host().diffs) == 6


def test_a_chunked_read_keeps_at_most_sample_size_diffs_per_chunk_until_the_merge() -> None:
    """Every chunk's diffs and keys were held until the end: 7.3 float64 copies per token at 10M tokens
    (bench_memory), where capping each chunk as it is read keeps the peak at 3.6."""
    from loops_callbacks.divergence import statistics

    batch = [{"tokens": [0] * 6, "logprobs": [None, -0.5, -0.25, -1.0, -2.0, -0.1], "mask": [1.0] * 6,
              "trainer": [None, -0.5, -0.5, -0.5, -1.0, -0.2]}] * 4
    held: list[int] = []
    concatenated = statistics.DivergenceStats.concatenated
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(statistics, "CHUNK_POSITIONS", 6)  # one datum a chunk
        patch.setattr(statistics.DivergenceStats, "concatenated",
                      staticmethod(lambda parts: held.extend(len(part.sample) for part in parts) or concatenated(parts)))
        got = stats_of(batch, 0, 3).to_host()
    assert held == [3, 3, 3, 3]  # 5 diffs a datum, 3 kept
    assert len(got.diffs) == 3


def test_the_statistics_options_check_their_counts_once_when_made() -> None:
    from loops_callbacks.divergence.statistics import StatisticsOptions

    with pytest.raises(TypeError, match=r"^top_n must be an int >= 0, got 1.5"):
        StatisticsOptions(top_n=1.5)
    with pytest.raises(ValueError, match=r"^sample_size must be an int >= 1 or None, got 0"):
        StatisticsOptions(sample_size=0)
    with pytest.raises(TypeError, match=r"^diagnose must be"):
        StatisticsOptions(diagnose="yes")
