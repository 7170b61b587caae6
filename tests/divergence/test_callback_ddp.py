"""Two ranks (DDP, gloo, CPU; run once for every 2-rank check, ``two_ranks``): rank 0 logs the metrics of
the union of both ranks' data, and every rank computes the same metrics (so the guard rail decides the
same everywhere)."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from loops_callbacks import KLSampleTrainMonitor
from tests.helpers import TinyPolicy, assert_metrics_equal, expected_metrics
from tests.oracle import PREFIX


class RecordingPolicy(TinyPolicy):
    """Saves each rank's micro-batches to ``out_dir`` when training ends."""

    def __init__(self, out_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def on_train_end(self) -> None:
        torch.save(self.recorded, os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))


class MetricsPerRank(pl.Callback):
    """Keeps the monitor's metrics after every logged step and saves them per rank at the end."""

    def __init__(self, monitor: KLSampleTrainMonitor, out_dir: str) -> None:
        self.monitor, self.out_dir, self.seen = monitor, out_dir, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.monitor.last_metrics and self.monitor.last_metrics not in self.seen:
            self.seen.append(dict(self.monitor.last_metrics))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.seen, os.path.join(self.out_dir, f"metrics{trainer.global_rank}.pt"))


def test_two_ranks_log_the_metrics_of_the_global_batch(two_rank_runs: tuple[Path, list[Any]]) -> None:
    tmp_path = two_rank_runs[0] / "global_batch"  # two_ranks.global_batch: 3 steps of 2 micro-batches on 2 ranks
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert not torch.equal(ranks[0][0]["input_ids"], ranks[1][0]["input_ids"])  # different data per rank
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        logged = [row for row in csv.DictReader(handle) if row.get(PREFIX + "kl_sample_train_k3")]
    assert [int(row["step"]) for row in logged] == [0, 1, 2]
    for row in logged:
        step = int(row["step"])
        window = [r for rank in ranks for r in rank if r["step"] == step]  # rank 0's micro-batches first
        want = expected_metrics(window)
        got = {key: float(row[key]) for key in want}
        assert got[PREFIX + "n_sequences"] == 16.0  # 2 ranks x 2 micro-batches x 4 rows
        assert_metrics_equal(got, want)
    per_rank = [torch.load(tmp_path / f"metrics{r}.pt", weights_only=False) for r in range(2)]
    exact = [[{key: repr(value) for key, value in metrics.items()} for metrics in rank] for rank in per_rank]
    assert len(exact[0]) == 3 and exact[0] == exact[1]  # identical, bit for bit, on both ranks (NaN as NaN)


DIFFERING = {  # each rank's value of the settings its monitor was given
    "corrections": (["token_truncate:2.0"], []),
    "max_groups": (8, 1000),
    "log_strata": (True, False),
    "diagnose": (True, False),
    "log_every_n_steps": (1, 2),
}


def test_ranks_whose_monitors_differ_fail_together_at_setup_naming_each_setting(
    two_rank_runs: tuple[Path, list[Any]],
) -> None:
    results = two_rank_runs[1]  # two_ranks.run_scenarios: monitors with each rank's value of DIFFERING
    for result in results:  # every rank, before any step
        message = result.get("error", "")
        assert message.startswith("RanksDisagreeError: KLSampleTrainMonitor: the ranks' monitors have"), message
        assert result["steps"] == 0
        said = {**{name: tuple(map(repr, values)) for name, values in DIFFERING.items()},
                "corrections": ("['token_truncate(clip_max=2.0)']", "[]")}  # by their log names
        for name, (rank0, rank1) in said.items():
            assert f"{name}: rank 0: {rank0}, rank 1: {rank1}" in message, message
    assert results[0]["error"] == results[1]["error"]
