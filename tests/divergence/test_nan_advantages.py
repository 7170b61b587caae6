"""Advantages holding NaN on masked-in positions are counted with the statistics and said once per run.

A NaN advantage counts as 0, so its tokens are not action tokens. The batch marks them on its own
device (``FlatBatch.advantage_nan``, with ``masked_in`` for the "of how many"); the statistics count
them (``n_advantage_nan``, ``n_masked_in``), which merge across micro-batches and ranks like every
total and reach the host in the step's one transfer; the monitor warns once per run from the
reduced totals, so a NaN on another rank, or on an accelerator, is said too.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence import statistics
from loops_callbacks.divergence.batch import flatten_datums, flatten_padded
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from loops_callbacks.divergence.monitor import MediaOptions
from tests.helpers import TinyPolicy, WarningsDuringFit, quiet_trainer

NAN = float("nan")
SAID = "holds NaN on"


def ragged_padded() -> dict[str, torch.Tensor]:
    """Three rows of 5, 3 and 0 masked-in positions (the rest padding), NaN advantages on both."""
    mask = torch.tensor([[1.0] * 5 + [0.0] * 3, [0.0, 1.0, 1.0, 1.0] + [0.0] * 4, [0.0] * 8])
    advantages = torch.ones(3, 8)
    advantages[0, 1] = advantages[0, 4] = NAN  # masked in
    advantages[1, 2] = NAN  # masked in
    advantages[0, 6] = advantages[1, 0] = advantages[2, 3] = NAN  # padding or masked out: no one's advantage
    advantages[1, 3] = 0.0  # a zero advantage: masked in, not NaN
    return {
        "sampler_logprobs": torch.full((3, 8), -1.0),
        "training_logprobs": torch.full((3, 8), -1.5),
        "mask": mask,
        "advantages": advantages,
    }


def counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(NaN advantages on masked-in positions, masked-in positions), counted here with numpy, row by row."""
    mask, advantages = batch["mask"].numpy(), batch["advantages"].numpy()
    if advantages.ndim == 1:
        advantages = np.repeat(advantages[:, None], mask.shape[1], axis=1)
    n_nan = sum(int(np.isnan(a) and m > 0) for row_a, row_m in zip(advantages, mask) for a, m in zip(row_a, row_m))
    return n_nan, int((mask > 0).sum())


def totals(flat: Any, **options: Any) -> tuple[float, float]:
    host = DivergenceStats.from_batch(flat, StatisticsOptions(**options)).to_host()
    return host.totals["n_advantage_nan"], host.totals["n_masked_in"]


def test_a_padded_batch_counts_nan_advantages_on_masked_in_positions_only() -> None:
    batch = ragged_padded()
    kept = {name: value.clone() for name, value in batch.items()}
    flat = flatten_padded(**batch)
    assert counts(batch) == (3, 8)
    assert flat.advantage_nan.reshape(3, 8).nonzero().tolist() == [[0, 1], [0, 4], [1, 2]]
    assert int(flat.masked_in.sum()) == 8 and int(flat.counted.sum()) == 8 - 3 - 1  # NaN and zero are not counted
    assert totals(flat) == (3.0, 8.0)
    assert totals(flat, diagnose=False) == (3.0, 8.0)  # the plain functions' statistics count them too
    for name, value in batch.items():  # the caller's tensors are not written
        assert torch.equal(value.isnan(), kept[name].isnan())
        assert torch.equal(value.nan_to_num(), kept[name].nan_to_num())


def test_one_advantage_per_row_counts_each_masked_in_position_of_its_row() -> None:
    batch = ragged_padded()
    batch["advantages"] = torch.tensor([NAN, 1.0, NAN])  # row 2 has no masked-in position
    assert totals(flatten_padded(**batch)) == (5.0, 8.0) and counts(batch) == (5, 8)


def test_without_advantages_every_masked_in_position_is_counted_and_none_is_nan() -> None:
    batch = ragged_padded()
    del batch["advantages"]
    flat = flatten_padded(**batch)
    assert flat.advantage_nan is None and torch.equal(flat.masked_in, flat.counted)
    assert totals(flat) == (0.0, 8.0)


def datums_of(batch: dict[str, torch.Tensor], per_datum: list[float] | None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The padded batch as datums cut to different lengths (7, 4, 2), with the advantages ``per_datum``
    (one value each), else the batch's per position."""
    data, trainer = [], []
    for i, length in enumerate((7, 4, 2)):
        advantage = [per_datum[i]] if per_datum is not None else batch["advantages"][i, :length].tolist()
        inputs = {
            "logprobs": batch["sampler_logprobs"][i, :length].tolist(),
            "mask": batch["mask"][i, :length].tolist(),
            "advantages": advantage,
        }
        data.append({"model_input": list(range(length)), "loss_fn_inputs": inputs})
        trainer.append(batch["training_logprobs"][i, :length])
    return data, trainer


@pytest.mark.parametrize("per_datum", [False, True])
def test_datums_count_nan_advantages_as_the_padded_form_does(per_datum: bool) -> None:
    batch = ragged_padded()
    data, trainer = datums_of(batch, [NAN, 1.0, NAN] if per_datum else None)
    flat = flatten_datums(data, trainer)
    n_nan = 5 if per_datum else 3  # datum 0's five masked-in positions (datum 2 has none), or the padded batch's three
    assert int(flat.advantage_nan.sum()) == n_nan and int(flat.masked_in.sum()) == 8
    assert totals(flat) == (float(n_nan), 8.0)


def test_the_count_merges_across_micro_batches_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = ragged_padded(), ragged_padded()
    second["advantages"][1, 1] = NAN  # one more, masked in
    a, b = DivergenceStats.from_batch(flatten_padded(**first)), DivergenceStats.from_batch(flatten_padded(**second))
    host = a.merge(b).to_host()
    assert (host.totals["n_advantage_nan"], host.totals["n_masked_in"]) == (3.0 + 4.0, 16.0)
    monkeypatch.setattr(statistics, "CHUNK_POSITIONS", 8)  # one datum per chunk on the CPU
    assert totals(flatten_padded(**second)) == (4.0, 8.0)


# --- the monitor ---------------------------------------------------------------------------


class NanOnRank(TinyPolicy):
    """Returns per-token advantages with NaN on ``nan_rank`` only: on two masked-in positions of the
    window's first micro-batch and one of its second, and on a masked-out one (the loss reads the
    batch's finite advantages, so training is unaffected)."""

    def __init__(self, out_dir: str | None = None, nan_rank: int = 0) -> None:
        super().__init__()
        self.out_dir, self.nan_rank = out_dir, nan_rank

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        output = super().training_step(batch, batch_idx)
        advantages = batch["advantages"][:, None].expand_as(batch["mask"]).clone()
        if self.global_rank == self.nan_rank:
            advantages[0, 0] = NAN  # masked out (mask 0 before position 3)
            advantages[1, -1] = NAN  # masked in (mask 1 from position 6 on)
            if batch_idx % 2 == 0:
                advantages[2, -2] = NAN
        output["advantages"] = advantages
        self.recorded[-1]["per_token_advantages"] = advantages.cpu()
        return output

    def on_train_end(self) -> None:
        if self.out_dir is not None:
            torch.save(self.recorded, os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))


class WarningsPerRank(WarningsDuringFit):
    """Records every warning a rank gives during fit, and saves what was said about NaN advantages."""

    def said(self, trainer: pl.Trainer, messages: list[str]) -> None:
        said = [message for message in messages if SAID in message]
        torch.save(said, os.path.join(self.out_dir, f"said{trainer.global_rank}.pt"))


def expected_message(window: list[dict[str, Any]], step: int) -> str:
    """The warning for one logged step, counted from the recorded micro-batches of every rank."""
    n_nan = sum(int((r["per_token_advantages"].isnan() & (r["mask"] > 0)).sum()) for r in window)
    n_masked_in = sum(int((r["mask"] > 0).sum()) for r in window)
    return f"KLSampleTrainMonitor, step {step}: 'advantages' {SAID} {n_nan} of the {n_masked_in} masked-in positions"


def test_the_monitor_says_a_window_of_micro_batches_once_per_run(tmp_path: Any) -> None:
    policy = NanOnRank(str(tmp_path))
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(policy)
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    assert len(said) == 1, said  # once per run, though both steps hold NaN
    window = [r for r in policy.recorded if r["step"] == 0]
    assert len(window) == 2 and said[0].startswith(expected_message(window, 0)), said
    assert "3 of the" in said[0]  # two in the first micro-batch, one in the second


def test_two_ranks_say_a_nan_of_rank_one_on_rank_zero(two_rank_runs: tuple[Path, Any]) -> None:
    """Only rank 1 has NaN advantages; rank 0 warns once, with the count of the reduced totals."""
    tmp_path = two_rank_runs[0] / "nan_on_rank_one"  # two_ranks.nan_on_rank_one: 2 steps of 2 micro-batches
    said = [torch.load(tmp_path / f"said{r}.pt", weights_only=False) for r in range(2)]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    window = [r for rank in ranks for r in rank if r["step"] == 0]
    assert len(window) == 4  # 2 ranks x 2 micro-batches
    assert not any(r["per_token_advantages"].isnan().any() for r in ranks[0])  # rank 0 has none of its own
    assert said[1] == [] and len(said[0]) == 1, said
    assert said[0][0].startswith(expected_message(window, 0)) and "3 of the" in said[0][0], said
