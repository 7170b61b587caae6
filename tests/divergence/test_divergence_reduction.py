"""Statistics reduced across ranks equal those of the union, in two fixed-size collectives.

Real processes (two ranks on gloo, ``two_ranks``) with uneven token counts and a rank without action
tokens; threads for the many generated cases; the sample's allocation on its own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.divergence.statistics import scalar_metrics
from loops_callbacks.distributed import ProcessGroup
from loops_callbacks.divergence.statistics import received_bytes, reduce_across_ranks, stratified_allocation
from loops_callbacks.divergence.statistics import ROW
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from loops_callbacks.divergence.statistics import parse_corrections
from tests.helpers import ThreadGroup, assert_metrics_equal, assert_totals_equal, reduce_in_threads, stats_of


def synthetic_rows(seed: int, datums: int, length: int, mask_rate: float) -> list[dict[str, Any]]:
    """Datums of random logprobs; ``mask_rate`` 0 gives datums without any action token."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(datums):
        sampler = -rng.exponential(size=length)
        out.append({
            "tokens": rng.integers(0, 50, size=length).tolist(),
            "logprobs": sampler.tolist(),
            "mask": (rng.random(length) < mask_rate).astype(float).tolist(),
            "trainer": (sampler + 0.3 * rng.standard_normal(length)).tolist(),
        })
    return out


SCENARIOS = {  # name: (rank 0's datums, rank 1's datums), each (seed, datums, length, mask rate)
    "uneven": ((1, 3, 10, 1.0), (2, 17, 10, 0.9)),
    "second_rank_has_no_action_tokens": ((3, 9, 12, 0.8), (4, 4, 6, 0.0)),
}


class CountingCollectives:
    """Counts the collectives another process group runs, and the elements each carries."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []
        self.rank, self.world_size = inner.rank, inner.world_size

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_gather", tensor.numel()))
        return self.inner.all_gather(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_reduce_sum", tensor.numel()))
        return self.inner.all_reduce_sum(tensor)


@pytest.fixture(scope="module")
def gloo_results(two_rank_runs: tuple[Path, Any]) -> list[dict[Any, Any]]:
    """Each rank's reduction of every scenario (``two_ranks.reductions``), on a real gloo process group."""
    return [torch.load(two_rank_runs[0] / "reductions" / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_gloo_ranks_equal_the_union(gloo_results: list[dict[Any, Any]], name: str) -> None:
    union = [row for spec in SCENARIOS[name] for row in synthetic_rows(*spec)]
    whole = stats_of(union, top_n=5).to_host()
    for by_scenario in gloo_results:
        result, calls = by_scenario[name, 100_000]
        host = result.to_host()
        assert_metrics_equal(scalar_metrics(host), scalar_metrics(whole))  # counts exact, sums to float64 order
        assert host.extrema == whole.extrema
        assert np.array_equal(host.worst, whole.worst)  # exact rows, datums renumbered
        assert np.array_equal(host.diffs, whole.diffs)  # under the cap: every diff, in rank order
        assert_totals_equal(host, whole)  # the diagnosis' sums, summed in the body
        assert 0 < whole.token_sums[0].sum() <= whole.totals["n_action_tokens"]  # the last position has no next id
        assert [kind for kind, _ in calls] == ["all_gather", "all_reduce_sum"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_gloo_ranks_share_a_capped_sample_by_their_counts(gloo_results: list[dict[Any, Any]], name: str) -> None:
    parts = [stats_of(synthetic_rows(*spec), top_n=5) for spec in SCENARIOS[name]]
    counts = [int(part.to_host().totals["n_action_tokens"]) for part in parts]
    union_diffs = [part.to_host().diffs for part in parts]
    first, second = (by_scenario[name, 7][0] for by_scenario in gloo_results)
    for a, b in [(first.sums, second.sums), (first.maxima, second.maxima), (first.worst, second.worst),
                 (first.sample, second.sample), (first.sample_keys, second.sample_keys)]:
        assert torch.equal(a, b)  # every rank ends with the same statistics
    kept = first.to_host().diffs
    assert kept.shape == (min(7, sum(counts)),)
    from_first = np.isin(kept, union_diffs[0])
    assert np.isin(kept[~from_first], union_diffs[1]).all()
    share = int(from_first.sum())  # rank 0's diffs come first, then rank 1's
    assert from_first.tolist() == [True] * share + [False] * (len(kept) - share)
    quota = 7 * counts[0] / sum(counts)
    assert np.floor(quota) <= share <= np.ceil(quota)


def test_bytes_per_rank_meet_the_bound_at_1024_ranks() -> None:
    assert received_bytes(world=1024, top_n=20, sample_size=100_000) <= 4_000_000
    growth = received_bytes(1024, 20, 100_000) - received_bytes(512, 20, 100_000)
    assert growth < 512 * 500  # under 500 B per added rank


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=8), sample_size=st.integers(1, 60))
def test_allocation_rounds_proportional_shares_and_keeps_each_token_with_probability_k_over_n(
    counts: list[int], sample_size: int
) -> None:
    n = torch.tensor(counts)
    total = sum(counts)
    kept = min(sample_size, total)
    quotas = np.array(counts, dtype=np.float64) * kept / max(total, 1)
    summed = np.zeros(len(counts), dtype=np.int64)
    for shift in range(max(total, 1)):  # every value of the shared shift s, equally likely
        share, start = stratified_allocation(n, sample_size, torch.tensor((shift + 0.5) / max(total, 1)))
        share_ = share.numpy()
        assert share_.sum() == kept
        assert (share_ >= np.floor(quotas)).all() and (share_ <= np.ceil(quotas)).all()
        assert (share_ <= np.array(counts)).all()
        assert start.tolist() == (np.cumsum(share_) - share_).tolist()
        summed += share_
    if total:  # the mean share over s is K * n_r / N exactly: inclusion probability K / N
        assert (summed == kept * np.array(counts)).all()


def test_threads_keep_every_token_about_equally_often() -> None:
    specs = [(11, 1, 5, 1.0), (12, 4, 5, 1.0), (13, 15, 5, 1.0)]  # 5, 20 and 75 action tokens
    parts_rows = [synthetic_rows(*spec) for spec in specs]
    union = np.concatenate([stats_of(rows, 0).to_host().diffs for rows in parts_rows])
    hits = np.zeros(union.shape[0])
    trials = 300
    for trial in range(trials):
        parts = [stats_of(rows, 0, sample_size=10, seed=1000 * trial + r) for r, rows in enumerate(parts_rows)]
        kept = reduce_in_threads(parts, seed=trial)[0].to_host().diffs
        assert kept.shape == (10,)
        hits += np.isin(union, kept)
    rate = hits / trials  # each of the 100 tokens: kept with probability 10 / 100
    assert abs(rate.mean() - 0.1) < 1e-12
    assert rate.min() > 0.1 - 5 * np.sqrt(0.09 / trials) and rate.max() < 0.1 + 5 * np.sqrt(0.09 / trials)


def test_ties_across_ranks_go_to_the_lower_rank_as_in_a_merge() -> None:
    rows = synthetic_rows(5, 3, 8, 1.0)
    parts = [stats_of(rows, 4), stats_of(rows, 4), stats_of(rows, 4)]  # every |d| tied three ways
    merged = parts[0].merge(parts[1]).merge(parts[2]).to_host()
    for result in reduce_in_threads(parts):
        assert np.array_equal(result.to_host().worst, merged.worst)
    first = merged.worst[0, ROW.DATUM]
    assert merged.worst[:3, ROW.DATUM].tolist() == [first, first + 3, first + 6]  # ranks 0, 1, 2
    assert len(set(merged.worst[:3, ROW.ABS].tolist())) == 1


def test_one_rank_gets_its_statistics_back() -> None:
    stats = stats_of(synthetic_rows(6, 2, 5, 1.0), 3, sample_size=4)
    assert not dist.is_initialized()
    assert reduce_across_ranks(stats, ProcessGroup()) is stats


class FakeStrategy:
    """A Lightning strategy not on torch.distributed: its own all_gather and reduce (with a barrier)."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.collectives, self.global_rank, self.world_size = group.for_rank(rank), rank, group.world
        self.reduce_ops: list[str] = []

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather(tensor)

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        self.reduce_ops.append(reduce_op)
        return self.collectives.all_reduce_sum(tensor)


def test_a_strategy_without_torch_distributed_is_served_by_its_own_collectives() -> None:
    import threading

    parts = [stats_of(synthetic_rows(7, 3, 6, 0.7), 2, 50), stats_of(synthetic_rows(8, 5, 6, 0.7), 2, 50)]
    group = ThreadGroup(2)
    strategies = [FakeStrategy(group, rank) for rank in range(2)]
    results: list[Any] = [None, None]

    def run(rank: int) -> None:
        results[rank] = reduce_across_ranks(parts[rank], strategies[rank], generator=torch.Generator())

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert type(ProcessGroup.of(strategies[0])).__name__ == "_StrategyGroup"
    assert strategies[0].reduce_ops == ["sum"]
    want = parts[0].merge(parts[1]).to_host()
    for result in results:
        assert np.array_equal(result.to_host().worst, want.worst)
        assert np.array_equal(result.to_host().diffs, want.diffs)


class MirrorCollectives:
    """A single process playing rank ``rank`` of ``world`` ranks that all hold its statistics."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.expand(self.world_size, *tensor.shape).clone()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reduction_on_cuda_does_not_synchronize_and_matches_the_cpu() -> None:
    from loops_callbacks.divergence.batch import flatten_padded

    generator = torch.Generator().manual_seed(0)
    sampler = -torch.rand(16, 64, generator=generator, dtype=torch.float64) * 5
    batch = {
        "sampler_logprobs": sampler,
        "training_logprobs": sampler + 0.05 * torch.randn(16, 64, generator=generator, dtype=torch.float64),
        "mask": (torch.rand(16, 64, generator=generator) > 0.2).float(),
    }
    results = {}
    for device in ("cpu", "cuda"):
        flat = flatten_padded(**{k: v.to(device) for k, v in batch.items()})
        stats = DivergenceStats.from_batch(flat, StatisticsOptions(top_n=20, sample_size=300),
                                           generator=torch.Generator(device))
        draw = torch.Generator(device).manual_seed(1)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            results[device] = reduce_across_ranks(stats, MirrorCollectives(1, 4), generator=draw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cpu, cuda = results["cpu"].to_host(), results["cuda"].to_host()
    assert np.array_equal(cpu.worst, cuda.worst) and cpu.extrema == cuda.extrema
    assert cpu.totals == pytest.approx(cuda.totals, rel=1e-12)
    assert cuda.diffs.shape == cpu.diffs.shape


def test_every_statistic_is_declared_once_with_a_formula_and_travels_by_name() -> None:
    from loops_callbacks.divergence.statistics import message_sizes
    from loops_callbacks.divergence.statistics import layout_of

    layout = layout_of(True, 8, parse_corrections(["geo"]))
    names = [state.name for state in layout.states]
    assert len(names) == len(set(names))
    with pytest.raises(KeyError, match=r"\['b'\] are computed but not declared; \[.*'n_datums'.*\] are declared"):
        layout.pack({"b": torch.tensor(1.0)})
    header, body = message_sizes(layout, top_n=3, sample_size=10)
    maxima = sum(math.prod(state.shape) for state in layout.states if state.reduction == "max")  # prompt_first: 20
    assert header == 2 + maxima + 3 + 1 + 1  # the two counts, the maxima, the worst |d|, the draw, the groups' width
    assert body == 3 * ROW.WIDTH + layout.sizes["sum"] + 10 + 1
