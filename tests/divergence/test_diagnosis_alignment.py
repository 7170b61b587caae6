"""Offsets of any size from ``alignment.offset_sums``, and the diagnosis that names them (or not)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.statistics import OFFSET_SIZE, offset_sums, read_offsets
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.diagnosis import diagnose
from loops_callbacks.divergence.statistics import signature_numbers
from tests.divergence.test_diagnosis import case, host_of


def moved(batch: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """The sampler's value of position k written at k + offset (0.0 where nothing lands)."""
    s = batch["sampler_logprobs"]
    out = torch.zeros_like(s)
    if offset > 0:
        out[:, offset:] = s[:, :-offset]
    else:
        out[:, :offset] = s[:, -offset:]
    return {**batch, "sampler_logprobs": out}


def diagnosed(batch: dict[str, torch.Tensor], *, with_offsets: bool = True) -> tuple[Diagnosis, dict[str, float]]:
    host = host_of(batch)
    if not with_offsets:  # the statistics without the votes
        host = dataclasses.replace(host, arrays={k: v for k, v in host.arrays.items() if k != "offset_sums"})
    sig = signature_numbers(host)
    return diagnose(sig, n_tokens=host.totals["n_action_tokens"]), sig


def left_aligned(seed: int = 1) -> dict[str, torch.Tensor]:
    """Completion-only sampler logprobs left at position 0; prompts of 3 to 11 tokens (mask 0 there)."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 64, 32
    trainer = -torch.rand(rows, width, generator=g) * 4
    prompt = torch.randint(3, 12, (rows,), generator=g)
    mask = (torch.arange(width)[None] >= prompt[:, None]).float()
    sampler = torch.zeros(rows, width)
    for row in range(rows):  # building the fixture only
        sampler[row, : width - prompt[row]] = trainer[row, prompt[row] :]
    return {"sampler_logprobs": sampler, "training_logprobs": trainer, "mask": mask}


@pytest.mark.parametrize("offset", [1, -1, 2, -2, 3, -3, 7])
@pytest.mark.parametrize("base", ["none", "precision"])
def test_an_offset_of_any_size_is_named_with_its_size_and_direction(offset: int, base: str) -> None:
    found, sig = diagnosed(moved(case(base), offset))
    assert sig["offset"] == offset and sig["offset_share"] == 1.0 and sig["offset_ratio"] < 1e-3
    assert found.cause == "shift" and found.confidence > 0.9
    size = "one position" if abs(offset) == 1 else f"{abs(offset)} positions"
    assert f"sampler logprobs are shifted by {size}" in found.message
    sign = "+" if offset > 0 else "−"
    assert f"the trainer's value at k matches the sampler's at k{sign}{abs(offset)})" in found.message


def test_offsets_beyond_one_were_not_named_by_the_one_position_rule() -> None:
    found, _ = diagnosed(moved(case("precision"), 3), with_offsets=False)
    assert found.cause != "shift"


def test_completion_only_logprobs_left_at_position_0_are_named_though_the_offset_differs_per_row() -> None:
    found, sig = diagnosed(left_aligned())
    assert sig["left_aligned_ratio"] == 0.0 and sig["left_aligned_share"] == 1.0
    assert sig["offset_share"] < 0.5  # no single offset: each row's is its prompt length
    assert found.cause == "shift" and "left-aligned at position 0" in found.message
    assert "k − the row's first action position" in found.message
    assert diagnosed(left_aligned(), with_offsets=False)[0].cause != "shift"  # the old rule missed it


def test_one_outlier_at_a_row_start_does_not_make_a_shift() -> None:
    batch = {key: value[:16] for key, value in case("precision").items()}  # 240 adjacent pairs
    batch["sampler_logprobs"] = batch["sampler_logprobs"].clone()
    batch["sampler_logprobs"][0, 0] = -9999.0
    assert diagnosed(batch, with_offsets=False)[0].cause == "shift"  # what the shift ratio alone said
    found, sig = diagnosed(batch)
    assert sig["offset"] == 0.0 and sig["offset_share"] == 1.0 and found.cause != "shift"


@pytest.mark.parametrize("cause", ["none", "precision", "temperature", "truncation", "stale", "unrelated"])
def test_aligned_batches_are_not_called_shifted(cause: str) -> None:
    found, sig = diagnosed(case(cause))
    assert found.cause != "shift", sig


def test_offset_sums_merge_by_sum_and_have_a_fixed_shape() -> None:
    batch = moved(case("precision", seed=3), 2)
    whole = offset_sums(flatten_padded(**batch))
    parts = [offset_sums(flatten_padded(**{k: v[i::3] for k, v in batch.items()})) for i in range(3)]
    assert whole.shape == (OFFSET_SIZE,) and whole.dtype == torch.float64
    assert torch.allclose(parts[0] + parts[1] + parts[2], whole, rtol=1e-12, atol=1e-9)
    nothing = torch.zeros(0, 4)
    empty = flatten_padded(sampler_logprobs=nothing, training_logprobs=nothing, mask=nothing)
    assert offset_sums(empty).shape == (OFFSET_SIZE,) and not offset_sums(empty).any()
    assert np.isnan(read_offsets(np.zeros(OFFSET_SIZE)).offset)
