"""Divergence by stratum (sampler probability, place in the completion, policy lag, group) and the
per-datum keys it reads: per-token sums as a plain loop computes them, exact under merging and
across ranks, the same on the accelerator's fixed-shape path. The diagnosis' offset votes
(``alignment.offset_sums``) merge the same way."""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.divergence import statistics as sums
from loops_callbacks.divergence.batch import FlatBatch, flatten_padded
from loops_callbacks.divergence.batch import ReadOptions, read_step
from loops_callbacks.divergence.statistics import GROUP_ROWS, LAG_LABELS, STRATUM_NAMES
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from tests.helpers import ThreadGroup, as_datums, reduce_in_threads, rows

MAX_GROUPS = 3
STEP = 12


def labelled(batch: list[dict[str, Any]], versions: list[int], groups: list[int]) -> list[dict[str, Any]]:
    """``batch`` with a policy version and a group per datum (as their ``loss_fn_inputs`` fields)."""
    return [{**row, "policy_version": [v], "group": [g]} for row, v, g in zip(batch, versions, groups)]


def flat_of(batch: list[dict[str, Any]]) -> FlatBatch:
    datums, trainer = as_datums(batch, "lists")
    for datum, row in zip(datums, batch):
        for key in ("policy_version", "group"):
            if key in row:
                datum.loss_fn_inputs[key] = row[key]
    return read_step({"training_logprobs": trainer, "data": datums}, None, optimizer_step=STEP)


def stats_of(batch: list[dict[str, Any]], sample_size: int | None = None) -> DivergenceStats:
    return DivergenceStats.from_batch(flat_of(batch), StatisticsOptions(max_groups=MAX_GROUPS, sample_size=sample_size))


def loop_oracle(flat: FlatBatch) -> dict[str, np.ndarray]:
    """Each stratum's (tokens, Σ k3, Σ |d|, Σ e^d), one token at a time: every fixed stratum, and each group
    with tokens."""
    sums = {name: np.zeros(4) for name in STRATUM_NAMES}
    edges = [math.log(p) for p in (0.01, 0.1, 0.5, 0.9)]
    start = 0
    for i, length in enumerate(flat.row_lengths.tolist()):
        actions = [k for k in range(start, start + length) if bool(flat.active[k])]
        for j, k in enumerate(actions):
            d, s = float(flat.diff[k]), float(flat.sampler[k])
            ratio = math.exp(min(d, 80.0))
            values = np.array([1.0, ratio - 1.0 - d, abs(d), ratio])
            names = [
                ["p_lt_0.01", "p_0.01_0.1", "p_0.1_0.5", "p_0.5_0.9", "p_ge_0.9"][sum(s >= e for e in edges)],
                f"pos_q{4 * j // len(actions) + 1}",
            ]
            if flat.lags is not None:
                lag = int(flat.lags[i])
                names.append(f"lag_{max(lag, 0)}" if lag < 4 else "lag_4_7" if lag < 8 else "lag_8_plus")
                names += ["lag_ahead"] if lag < 0 else []
            if flat.groups is not None:
                group = int(flat.groups[i])
                names.append(f"group_{group}" if group < MAX_GROUPS else "group_other")
            for name in names:
                sums.setdefault(name, np.zeros(4))
                sums[name] += values
        start += length
    return sums


def assert_strata_equal(got: Any, want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()  # the groups without tokens are not kept
    for name, values in want.items():
        stratum = got[name]
        assert stratum.n_tokens == values[0], name  # counts: exact
        np.testing.assert_allclose(
            [stratum.sum_k3, stratum.sum_abs_d, stratum.sum_is_ratio], values[1:], rtol=1e-9, atol=1e-9, err_msg=name
        )


labelled_rows = rows(max_datums=8).flatmap(
    lambda batch: st.tuples(
        st.just(batch),
        st.lists(st.integers(0, STEP + 2), min_size=len(batch), max_size=len(batch)),  # some ahead of the trainer
        st.lists(st.integers(0, 2 * MAX_GROUPS), min_size=len(batch), max_size=len(batch)),
    )
)


@settings(max_examples=60, deadline=None)
@given(case=labelled_rows, masked=st.booleans())
def test_stratum_sums_equal_a_token_by_token_loop(case: Any, masked: bool) -> None:
    batch = labelled(*case)
    flat = flat_of(batch)
    with pytest.MonkeyPatch.context() as patch:
        if masked:  # the accelerator's fixed-shape path (index_add_, no bincount), run on the CPU
            patch.setattr(sums, "_on_host", lambda device: False)
        host = DivergenceStats.from_batch(flat, StatisticsOptions(max_groups=MAX_GROUPS)).to_host()
    assert_strata_equal(host.strata, loop_oracle(flat))
    assert [label for label in host.by_lag] == (list(LAG_LABELS) if host.strata["pos_q1"].n_tokens else [])


def test_lags_are_the_trainer_step_minus_the_version_and_by_lag_reads_them() -> None:
    batch = [
        {"tokens": [1, 2, 3], "logprobs": [None, -1.0, -2.0], "mask": [0.0, 1.0, 1.0], "trainer": [None, -1.5, -2.0]},
        {"tokens": [1, 2], "logprobs": [None, -0.5], "mask": [0.0, 1.0], "trainer": [None, -0.25]},
    ]
    flat = flat_of(labelled(batch, versions=[STEP, STEP - 5], groups=[0, 0]))
    assert flat.lags.tolist() == [0, 5]
    by_lag = DivergenceStats.from_batch(flat, StatisticsOptions(max_groups=MAX_GROUPS)).to_host().by_lag
    assert list(by_lag) == ["0", "1", "2", "3", "4-7", "8+"]
    assert (by_lag["0"].n_tokens, by_lag["4-7"].n_tokens, by_lag["1"].n_tokens) == (2.0, 1.0, 0.0)
    assert by_lag["4-7"].abs_d_mean == 0.25
    assert by_lag["0"].k3 == pytest.approx((math.exp(-0.5) - 1 + 0.5) / 2)
    plain = DivergenceStats.from_batch(flat_of(batch), StatisticsOptions(max_groups=MAX_GROUPS)).to_host()
    assert plain.by_lag == {} and not any(name.startswith("group_") for name in plain.strata)  # no versions, no groups


@settings(max_examples=40, deadline=None)
@given(case=labelled_rows, cuts=st.lists(st.integers(0, 8), max_size=3))
def test_merged_micro_batches_and_ranks_equal_the_whole(case: Any, cuts: list[int]) -> None:
    batch = labelled(*case)
    bounds = sorted({min(c, len(batch)) for c in cuts} | {0, len(batch)})
    parts = [batch[a:b] for a, b in zip(bounds, bounds[1:])] or [[]]
    whole = loop_oracle(flat_of(batch))
    offsets = stats_of(batch).to_host().offset_sums
    merged = stats_of(parts[0])
    for part in parts[1:]:
        merged = merged.merge(stats_of(part))
    assert_strata_equal(merged.to_host().strata, whole)
    np.testing.assert_allclose(merged.to_host().offset_sums, offsets, rtol=1e-12, atol=1e-12)
    if len(parts) == 1:
        parts.append([])  # a rank with nothing at all
    for result in reduce_in_threads([stats_of(part, sample_size=1000) for part in parts]):
        assert_strata_equal(result.to_host().strata, whole)
        np.testing.assert_allclose(result.to_host().offset_sums, offsets, rtol=1e-12, atol=1e-12)


def test_per_datum_keys_are_read_from_the_batch() -> None:
    padded = {
        "logprobs": torch.tensor([[-1.0, -2.0], [-0.5, -0.5]]),
        "mask": torch.ones(2, 2),
        "policy_version": torch.tensor([3, 1]),
        "group": [0, 5],
    }
    output = {"training_logprobs": torch.tensor([[-1.5, -2.0], [-0.5, -0.25]])}
    flat = read_step(output, padded, optimizer_step=4)
    assert flat.lags.tolist() == [1, 3] and flat.groups.tolist() == [0, 5]
    renamed = {key: value for key, value in padded.items() if key != "policy_version"}
    renamed["version"] = padded["policy_version"]
    flat = read_step(output, renamed, ReadOptions(keys={"policy_version": "version"}), optimizer_step=4)
    assert flat.lags.tolist() == [1, 3]
    assert read_step(output, renamed, optimizer_step=4).lags is None  # not under its default key


PADDED = {"logprobs": torch.tensor([[-1.0, -2.0], [-0.5, -0.5]]), "mask": torch.ones(2, 2)}
OUTPUT = {"training_logprobs": torch.tensor([[-1.5, -2.0], [-0.5, -0.25]])}


def read_warned(extra: dict[str, Any], match: str, *, max_groups: int = MAX_GROUPS) -> FlatBatch:
    """``read_step`` of ``PADDED`` with ``extra``: it warns ``match`` once, and never raises."""
    with pytest.warns(UserWarning, match=match) as seen:
        flat = read_step(OUTPUT, {**PADDED, **extra}, ReadOptions(max_groups=max_groups), optimizer_step=4)
    assert len(seen) == 1
    return flat


def test_per_datum_values_the_strata_cannot_use_are_warnings_never_errors() -> None:
    """Monitoring never stops training: each problem is one warning naming the key, a value and its datum."""
    flat = read_warned({"group": [-1, 0]}, r"datum 0 has 'group' = -1 \(< 0\).*'group_other'")
    assert flat.groups.tolist() == [MAX_GROUPS, 0]  # group_other's index
    host = DivergenceStats.from_batch(flat, StatisticsOptions(max_groups=MAX_GROUPS)).to_host()
    assert (host.strata["group_other"].n_tokens, host.strata["group_0"].n_tokens) == (2.0, 2.0)
    flat = read_warned({"group": ["math", "code"]}, r"'group' holds labels \(datum 0: 'math'\).*crc32")
    assert flat.groups.tolist() == [zlib.crc32(b"math") % MAX_GROUPS, zlib.crc32(b"code") % MAX_GROUPS]
    flat = read_warned({"policy_version": [5, 2]}, r"datum 0 has 'policy_version' = 5, ahead of the trainer's "
                       r"optimizer step 4 \(1 of 2 datums.*lag 0")
    assert flat.lags.tolist() == [-1, 2]  # counted at lag 0 and in lag_ahead
    host = DivergenceStats.from_batch(flat, StatisticsOptions(max_groups=MAX_GROUPS)).to_host()
    assert [host.strata[name].n_tokens for name in ("lag_0", "lag_ahead", "lag_2")] == [2.0, 2.0, 2.0]
    for extra, match in (
        ({"policy_version": [1, 1, 1]}, r"'policy_version' has 3 values for 2 datums; the strata by policy lag are"),
        ({"policy_version": [-1, 1]}, r"datum 0 has 'policy_version' = -1"),
        ({"policy_version": ["v1", "v2"]}, r"'policy_version' must count optimizer steps, got labels"),
        ({"group": [0.0, 1.5]}, r"'group' must hold integers, got 1.5 at datum 1; the strata by group are off"),
        ({"group": ["math", 1]}, r"'group' must be one int \(or one string label\) per datum"),
    ):
        flat = read_warned(extra, match)
        assert flat.lags is None and flat.groups is None, extra
    assert torch.equal(PADDED["logprobs"], torch.tensor([[-1.0, -2.0], [-0.5, -0.5]]))  # the caller's data untouched


def test_a_key_on_only_some_datums_turns_its_family_off_with_a_warning() -> None:
    batch = [
        {"tokens": [1, 2], "logprobs": [None, -1.0], "mask": [0.0, 1.0], "trainer": [None, -1.5],
         "policy_version": [3]},
        {"tokens": [1, 2], "logprobs": [None, -1.0], "mask": [0.0, 1.0], "trainer": [None, -1.5], "group": [1],
         "policy_version": [STEP]},
    ]
    with pytest.warns(UserWarning, match=r"'group': datum 1 has it in loss_fn_inputs but datum 0 does not"):
        flat = flat_of(batch)
    assert flat.groups is None and flat.lags.tolist() == [STEP - 3, 0]
    labels = [{**row, "group": ["code" if i else "math"]} for i, row in enumerate(batch)]
    with pytest.warns(UserWarning, match="holds labels"):
        assert flat_of(labels).groups.tolist() == [zlib.crc32(b"math") % 8, zlib.crc32(b"code") % 8]


def test_per_token_advantages_give_each_row_its_value_on_its_counted_tokens() -> None:
    """verl keeps advantages [B, T] and Tinker datums per position: each row reads the value of its counted tokens."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    padded = {"logprobs": torch.full((2, 4), -1.0), "mask": mask,
              "advantages": torch.tensor([[0.0, -0.5, -0.5, 0.0], [2.0, 2.0, 0.0, 0.0]])}
    output = {"training_logprobs": torch.full((2, 4), -1.25)}
    flat = read_step(output, padded, ReadOptions(datum_advantages=True))
    assert flat.datum_advantages.tolist() == [-0.5, 2.0]
    assert torch.equal(padded["advantages"][0], torch.tensor([0.0, -0.5, -0.5, 0.0]))  # the caller's data untouched
    differing = {**padded, "advantages": torch.tensor([[9.0, -0.5, -1.5, 9.0], [2.0, 2.0, 0.0, 0.0]])}
    with pytest.warns(UserWarning, match=r"datum 0's per-token 'advantages' differ on its counted tokens \(-1.5 to "
                      r"-0.5\); the corrections read each row's mean \(-1 here\)"):
        flat = read_step(output, differing, ReadOptions(datum_advantages=True))
    assert flat.datum_advantages.tolist() == [-1.0, 2.0]
    batch = [
        {"tokens": [1, 2, 3], "logprobs": [None, -1.0, -2.0], "mask": [0.0, 1.0, 1.0], "trainer": [None, -1.5, -2.0],
         "advantages": [0.0, -0.25, -0.25]},
        {"tokens": [1, 2], "logprobs": [None, -0.5], "mask": [0.0, 1.0], "trainer": [None, -0.25], "advantages": [3.0]},
    ]
    datums, trainer = as_datums(batch, "lists")
    for datum, row in zip(datums, batch):
        datum.loss_fn_inputs["advantages"] = row["advantages"]
    flat = read_step({"training_logprobs": trainer, "data": datums}, None, ReadOptions(datum_advantages=True))
    assert flat.datum_advantages.tolist() == [-0.25, 3.0]


def test_the_strata_read_the_k3_the_statistics_computed() -> None:
    """k3 is computed once per chunk: the strata sum the k3 they are handed, they do not compute their own."""
    d = torch.tensor([0.5, -0.25, 0.1], dtype=torch.float64)
    handed = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)  # not e^d - 1 - d: only a sum of it can give 7
    p_bucket = sums._probability_buckets(torch.log(torch.tensor([0.005, 0.05, 0.95])))
    out = sums._strata_sums(d, d.abs(), d.exp(), handed, torch.zeros(3, dtype=torch.int64), torch.arange(3), p_bucket,
                            torch.tensor([3]), None, None)
    assert out[1, STRATUM_NAMES.index("p_lt_0.01")] == 1.0 and out[1, STRATUM_NAMES.index("p_ge_0.9")] == 4.0
    assert out[1].sum() == 2 * 7.0  # the probability and the position families each hold all of it


def test_what_the_groups_cost_follows_the_groups_given_never_max_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a ``group`` key nothing is kept for groups; with one, a column per group seen (and across
    ranks as many as the largest index seen), whatever ``max_groups``."""
    sent: list[int] = []
    exchange = ThreadGroup.exchange
    monkeypatch.setattr(ThreadGroup, "exchange", lambda group, rank, tensor: sent.append(tensor.numel()) or
                        exchange(group, rank, tensor))
    flat = flatten_padded(sampler_logprobs=torch.full((3, 4), -1.0), training_logprobs=torch.full((3, 4), -1.25),
                          mask=torch.ones(3, 4))
    grouped = dataclasses.replace(flat, groups=torch.tensor([7, 3, 7]))
    pooled = dataclasses.replace(flat, groups=torch.tensor([0, 10**12, 0]))  # group_other: no wider
    for max_groups in (8, 10**6):
        plain = DivergenceStats.from_batch(flat, StatisticsOptions(max_groups=max_groups))
        assert plain.groups is None
        assert not any(name.startswith("group_") for name in plain.to_host().strata)
        stats = DivergenceStats.from_batch(grouped, StatisticsOptions(max_groups=max_groups))
        assert stats.groups.shape == (GROUP_ROWS, 2)  # groups 3 and 7
        host = stats.to_host().strata
        assert [name for name in host if name.startswith("group_")] == ["group_3", "group_7"]
        assert (host["group_3"].n_tokens, host["group_7"].n_tokens) == (4.0, 8.0)
        sent.clear()
        other = DivergenceStats.from_batch(pooled, StatisticsOptions(max_groups=max_groups))
        for result in reduce_in_threads([plain, stats, other]):
            host = result.to_host().strata
            assert (host["group_7"].n_tokens, host["group_0"].n_tokens, host["group_other"].n_tokens) == (8, 8, 4)
        if max_groups == 8:
            sizes = list(sent)
        assert sent == sizes  # what the ranks exchange does not grow with max_groups


def test_on_an_accelerator_the_groups_width_is_fixed_and_the_reduction_gives_the_same_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the CPU the groups take max_groups + 1 body columns, so that no host read waits for the device;
    the reduced groups are the same as with the width the headers give on the CPU."""
    from loops_callbacks.divergence import statistics as reduction

    assert reduction._groups_width(StatisticsOptions(max_groups=5).layout, torch.zeros(2, 1, device="meta")) == 6
    flat = flatten_padded(sampler_logprobs=torch.full((3, 4), -1.0), training_logprobs=torch.full((3, 4), -1.25),
                          mask=torch.ones(3, 4))
    parts = [DivergenceStats.from_batch(dataclasses.replace(flat, groups=torch.tensor(groups)),
                                        StatisticsOptions(max_groups=8))
             for groups in ([7, 3, 7], [0, 10**12, 0])]
    on_cpu = [result.to_host().strata for result in reduce_in_threads(parts)]
    monkeypatch.setattr(reduction, "_groups_width", lambda layout, widths: layout.max_groups + 1)
    fixed = [result.to_host().strata for result in reduce_in_threads(parts)]
    for cpu, accelerator in zip(on_cpu, fixed):
        assert {k: v for k, v in accelerator.items() if v.n_tokens} == {k: v for k, v in cpu.items() if v.n_tokens}
