"""Two ranks (ddp_spawn, gloo, CPU): rank 0 logs the metrics of the union of both ranks' data,
and every rank computes the same metrics (so the guard rail decides the same everywhere)."""

from __future__ import annotations

import csv
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from loops_callbacks import KLSampleTrainMonitor
from tests.helpers import CleanDistributedExit, TinyPolicy, assert_metrics_equal, expected_metrics, quiet_trainer
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


def test_two_ranks_log_the_metrics_of_the_global_batch(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    monitor = KLSampleTrainMonitor(log_worst_tokens=False)
    trainer = quiet_trainer(
        strategy="ddp_spawn", devices=2, max_steps=3, accumulate_grad_batches=2, logger=logger,
        callbacks=[monitor, MetricsPerRank(monitor, str(tmp_path)), CleanDistributedExit()],
    )
    trainer.fit(RecordingPolicy(str(tmp_path)))
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
    assert len(per_rank[0]) == 3 and per_rank[0] == per_rank[1]  # identical, bit for bit, on both ranks
