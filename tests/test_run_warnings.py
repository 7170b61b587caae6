"""The one warning channel: rank 0 only, once per key within a run, with the caller's category."""

from __future__ import annotations

import warnings

import pytest
from lightning_utilities.core.rank_zero import rank_zero_only

from loops_callbacks import run_warnings
from loops_callbacks.reference.across_ranks import ReferenceCacheWarning


def test_only_rank_zero_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_warnings.warn("the cache is stale", ReferenceCacheWarning)
        run_warnings.RunWarnings().warn("nan", "every logprob is NaN")
    assert caught == []
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    with pytest.warns(ReferenceCacheWarning, match="the cache is stale"):
        run_warnings.warn("the cache is stale", ReferenceCacheWarning)


def test_once_per_key_until_a_new_run() -> None:
    channel = run_warnings.RunWarnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            channel.warn("logger:CSVLogger", "could not log")
        channel.reset()
        channel.warn("logger:CSVLogger", "could not log")
    assert len(caught) == 2


def test_outside_lightning_the_rank_is_torchruns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(rank_zero_only, "rank", raising=False)
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_warnings.warn("the cache is stale", ReferenceCacheWarning)
    assert caught == [] and rank_zero_only.rank == 1
