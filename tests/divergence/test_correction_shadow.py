"""Shadow statistics of corrections: they merge exactly across parts of a batch and say what applying would do."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.correction import apply_correction, parse_correction
from loops_callbacks.divergence.batch import flatten_datums, flatten_padded
from loops_callbacks.divergence.statistics import (
    no_advantage_message, parse_corrections, shadow_scalars, shadow_statistics, shadow_values,
)
from loops_callbacks.divergence.statistics import DivergenceStats
from loops_callbacks.types import Datum, ModelInput
from tests.helpers import TinyPolicy, WarningsDuringFit
from tests.oracle import PREFIX

CORRECTIONS = parse_corrections([
    "sequence_mask", "token_truncate:2.0", "token_mask:0.5_2.0", "sequence_truncate", "token_tis", "sequence_tis",
    "geo", "seq_mean_k1:0.9_1.1", "token_k3:0.05", "seq_max_k2:0.5", "seq_sum_k1:0.5_2.0", "icepop",
    "off_policy_mask:0.02",
])


def ragged(seed: int, n_datums: int = 7) -> tuple[list[Datum], list[list[float]], torch.Tensor]:
    """Datums of different lengths (a prompt, NaN and missing sampler logprobs, one without action tokens)."""
    generator = torch.Generator().manual_seed(seed)
    data, trainers = [], []
    for i in range(n_datums):
        length = int(torch.randint(1, 14, (1,), generator=generator))
        prompt = min(length - 1, int(torch.randint(0, 4, (1,), generator=generator)))
        trainer = (-torch.rand(length, generator=generator) * 3).tolist()
        scale = [0.001, 0.05, 0.3, 1.0][i % 4]
        sampler: list[float | None] = [t - scale * float(torch.randn(1, generator=generator)) for t in trainer]
        if length > 3 and i % 3 == 1:
            sampler[-1] = math.nan if i % 2 else None
        mask = [0.0] * prompt + [1.0] * (length - prompt)
        if i == 4:
            mask = [0.0] * length  # no action token at all
        data.append(Datum(ModelInput.from_ints(list(range(length))), {"logprobs": sampler, "mask": mask}))
        trainers.append(trainer)
    advantages = torch.randn(n_datums, generator=generator)
    return data, trainers, advantages


def merged(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    reductions = {s.name: s.reduction for s in shadow_statistics(CORRECTIONS)}
    out = dict(parts[0])
    for part in parts[1:]:
        for name, value in part.items():
            out[name] = out[name] + value if reductions[name] == "sum" else torch.maximum(out[name], value)
    return out


def scalars_of(values: dict[str, torch.Tensor]) -> dict[str, float]:
    reductions = {s.name: s.reduction for s in shadow_statistics(CORRECTIONS)}
    totals = {n: v for n, v in values.items() if reductions[n] == "sum"}
    extrema = {n: v for n, v in values.items() if reductions[n] == "max"}
    return shadow_scalars(totals, extrema, CORRECTIONS)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 7), min_size=1, max_size=3))
def test_parts_of_a_batch_merge_into_the_whole(seed: int, cuts: list[int]) -> None:
    data, trainers, advantages = ragged(seed)
    whole = shadow_values(flatten_datums(data, trainers), CORRECTIONS, advantages)
    bounds = sorted({0, len(data), *cuts})
    parts = [shadow_values(flatten_datums(data[a:b], trainers[a:b]), CORRECTIONS, advantages[a:b])
             for a, b in itertools.pairwise(bounds)]
    got = merged(parts)
    assert got.keys() == whole.keys()
    for name, value in whole.items():
        if ":n_" in name or name.startswith(("correction::max", "correction::neg_min")):
            assert got[name].item() == value.item(), name  # counts and extrema: exact
        else:
            assert got[name].item() == pytest.approx(value.item(), rel=1e-12, abs=1e-12), name
    assert scalars_of(got) == pytest.approx(scalars_of(whole), rel=1e-12, abs=1e-12)


def test_the_statistics_are_declared_with_their_reductions() -> None:
    data, trainers, advantages = ragged(0)
    values = shadow_values(flatten_datums(data, trainers), CORRECTIONS, advantages)
    declared = shadow_statistics(CORRECTIONS)
    assert [s.name for s in declared] == list(values) or {s.name for s in declared} == set(values)
    assert len({s.name for s in declared}) == len(declared)
    assert {s.reduction for s in declared} == {"sum", "max"}
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in values.values())
    assert shadow_statistics([]) == () and shadow_values(flatten_datums(data, trainers), []) == {}


def test_the_shares_and_sizes_are_what_applying_the_correction_does() -> None:
    """On the tokens the main metrics count: a missing or ±inf logprob is in none of the statistics
    (a row with a +inf and a -inf log ratio made sequence_tis NaN and dropped the raw sequence extremes)."""
    generator = torch.Generator().manual_seed(7)
    trainer = -torch.rand(9, 12, generator=generator) * 2
    sampler = trainer - torch.randn(9, 12, generator=generator) * torch.linspace(0.0002, 1.0, 9)[:, None]
    mask = (torch.arange(12)[None, :] < torch.randint(1, 13, (9,), generator=generator)[:, None]).float()
    mask[2, :4] = 1.0
    sampler[7] -= 0.5  # a sequence ratio of about e^2 (6 tokens): sequence_mask drops it
    sampler[2, 0], sampler[2, 3], trainer[8, 0], sampler[5, 0] = -math.inf, math.inf, -math.inf, math.nan
    advantages = torch.randn(9, generator=generator)
    flat = flatten_padded(sampler_logprobs=sampler, training_logprobs=trainer, mask=mask)
    values = shadow_values(flat, CORRECTIONS, advantages)
    scalars = scalars_of(values)
    action = (mask > 0) & torch.isfinite(trainer - sampler)
    n, n_seqs = int(action.sum()), int(action.any(dim=1).sum())
    assert values["correction::n_tokens"] == DivergenceStats.from_batch(flat).to_host().totals["n_action_tokens"] == n
    assert all(math.isfinite(v) for v in scalars.values()) and "correction/raw/seq_ratio_max" in scalars
    for spec in CORRECTIONS:
        result = apply_correction(spec, trainer.double(), sampler.double(), mask, advantages=advantages)
        name = f"correction/{parse_correction(spec).name}/"
        dropped = action & ~result.keep
        assert scalars[name + "frac_tokens_masked"] == int(dropped.sum()) / n, spec
        assert scalars[name + "frac_seqs_masked"] == int(dropped.any(dim=1).sum()) / n_seqs, spec
        assert scalars[name + "frac_tokens_clipped"] == int((result.clipped & action).sum()) / n, spec
        w = result.weights[action]
        assert scalars[name + "ess_tokens"] == pytest.approx(float(w.sum() ** 2 / (n * (w**2).sum())), rel=1e-12)
        seq_w = ((result.weights * action).sum(dim=1) / action.sum(dim=1))[action.any(dim=1)]
        ess_seqs = float(seq_w.sum() ** 2 / (n_seqs * (seq_w**2).sum())) if seq_w.any() else 0.0
        assert scalars[name + "ess_seqs"] == pytest.approx(ess_seqs, rel=1e-12)
        assert scalars[name + "mean_weight"] == pytest.approx(float(w.mean()), rel=1e-12)
    assert 0 < scalars["correction/sequence_mask/frac_seqs_masked"] < 1
    assert 0 < scalars["correction/geo/frac_seqs_masked"] < 1


def test_the_raw_ratio_extremes_read_only_action_tokens() -> None:
    """Padding never reads as a ratio of 0 (SkyRL's is_ratio_min does); the extremes are before any truncation."""
    trainer = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -30.0], [0.0, 0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, 0.0, 0.0], [-0.8, -1.0, -0.9, 0.0], [-5.0, -5.0, -5.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2: no action
    flat = flatten_padded(sampler_logprobs=sampler, training_logprobs=trainer, mask=mask)
    scalars = scalars_of(shadow_values(flat, CORRECTIONS, torch.ones(3)))
    d = [[0.5, -1.0], [-0.2, 0.0, -0.1]]  # every sequence's ratio is below 1: an empty row would read as 1
    assert scalars["correction/raw/token_ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert scalars["correction/raw/token_ratio_min"] == pytest.approx(math.exp(-1.0), rel=1e-6)
    assert scalars["correction/raw/seq_ratio_max"] == pytest.approx(math.exp(sum(d[1])), rel=1e-6)
    assert scalars["correction/raw/seq_ratio_min"] == pytest.approx(math.exp(sum(d[0])), rel=1e-6)
    assert scalars["correction/raw/seq_geo_ratio_max"] == pytest.approx(math.exp(sum(d[1]) / 3), rel=1e-6)


def test_a_batch_without_action_tokens_logs_nothing() -> None:
    flat = flatten_padded(sampler_logprobs=torch.zeros(2, 3), training_logprobs=torch.zeros(2, 3),
                          mask=torch.zeros(2, 3))
    assert scalars_of(shadow_values(flat, CORRECTIONS, torch.ones(2))) == {}
    empty = flatten_padded(sampler_logprobs=torch.zeros(0, 3), training_logprobs=torch.zeros(0, 3), mask=torch.zeros(0, 3))
    assert scalars_of(shadow_values(empty, CORRECTIONS, torch.zeros(0))) == {}


def test_bad_lists_and_advantages_are_refused() -> None:
    zeros = torch.zeros(2, 3)
    flat = flatten_padded(sampler_logprobs=zeros, training_logprobs=zeros, mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\['geo'\] are listed more than once"):
        parse_corrections(["geo", "seq_mean_k1:0.999_1.001", "geo"])
    with pytest.raises(TypeError, match="a list of specs"):
        parse_corrections("geo")
    with pytest.raises(TypeError, match=r"must be a list of specs, got a dict \(\{'token_truncate': \{'clip_max': "
                                        r"1.5\}\}\); write e.g. .* \[Correction\('token_truncate', "):
        KLSampleTrainMonitor(corrections={"token_truncate": {"clip_max": 1.5}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the advantages"):
        shadow_values(flat, parse_corrections(["off_policy_mask:0.1"]))


def test_a_sequence_without_a_usable_advantage_counts_as_masked_and_its_rank_is_said() -> None:
    """NaN marks a datum whose advantages could not be read (``step_input``): off_policy_mask cannot judge it."""
    zeros = torch.zeros(3, 2)
    flat = flatten_padded(sampler_logprobs=zeros, training_logprobs=zeros, mask=torch.ones(3, 2))
    spec = parse_corrections(["off_policy_mask:0.02"])
    rank_1, rank_3 = (shadow_values(flat, spec, torch.ones(3), rank=1),
                      shadow_values(flat, spec, torch.tensor([1.0, math.nan, math.nan]), rank=3))
    assert no_advantage_message(rank_1, rank_1, "'advantages'") is None
    both = merged([rank_1, rank_3])
    assert shadow_scalars(both, both, spec)["correction/off_policy_mask(threshold=0.02)/frac_seqs_masked"] == 2 / 6
    assert no_advantage_message(both, both, "'advantages'").startswith(
        "off_policy_mask had no usable 'advantages' for 2 of the step's 6 sequences, on rank 3;")
    three = merged([shadow_values(flat, spec, torch.tensor([math.nan, 1.0, 1.0]), rank=0), rank_1, rank_3])
    assert "3 of the step's 9 sequences, on ranks 0 (lowest) to 3 (highest);" in no_advantage_message(
        three, three, "'advantages'")


SAID = "had no usable 'advantages'"


class NoAdvantagesOnRankOne(TinyPolicy):
    """Rank 1's batches lose their advantages before the monitor reads them (the loss still has its own)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.global_rank == 1:
            self.popped = batch.pop("advantages")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return super().training_step({"advantages": getattr(self, "popped", None), **batch}, batch_idx)

    def on_train_end(self) -> None:
        torch.save(self.recorded, os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))


class SaidPerRank(WarningsDuringFit):
    """Saves what each rank warned about advantages during fit, and the correction metrics it ended with."""

    def said(self, trainer: pl.Trainer, messages: list[str]) -> None:
        said = [message for message in messages if "advantage" in message]
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "/correction/" in k}
        torch.save((said, metrics), os.path.join(self.out_dir, f"said{trainer.global_rank}.pt"))


def test_two_ranks_say_on_rank_zero_that_rank_one_had_no_advantages_and_mask_its_sequences(
    two_rank_runs: tuple[Path, Any],
) -> None:
    """Only rank 0 speaks (one channel); it names rank 1 from the reduced counts, and rank 1's sequences,
    which off_policy_mask cannot judge, count as masked (a threshold of 100 masks none of rank 0's)."""
    tmp_path = two_rank_runs[0] / "no_advantages_on_rank_one"  # two_ranks.no_advantages_on_rank_one: one step
    (said0, metrics), (said1, _) = [torch.load(tmp_path / f"said{r}.pt", weights_only=False) for r in range(2)]
    first = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)[0] for r in range(2)]
    n0 = int(((first[0]["mask"] > 0) & (first[0]["advantages"][:, None] != 0)).any(dim=1).sum())
    n1 = int((first[1]["mask"] > 0).any(dim=1).sum())  # rank 1 read no advantages: every masked-in row counts
    assert said1 == [] and len(said0) == 1, (said0, said1)
    assert f"{SAID} for {n1} of the step's {n0 + n1} sequences, on rank 1;" in said0[0]
    assert metrics[PREFIX + "correction/off_policy_mask(threshold=100.0)/frac_seqs_masked"] == n1 / (n0 + n1)
