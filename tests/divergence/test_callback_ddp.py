"""Two ranks (ddp_spawn, gloo, CPU): rank 0 logs the metrics of the union of both ranks' data,
and every rank computes the same metrics (so the guard rail decides the same everywhere)."""

from __future__ import annotations

import csv
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from loops_callbacks import KLSampleTrainMonitor
from tests.helpers import (
    CleanDistributedExit,
    TinyPolicy,
    assert_metrics_equal,
    expected_metrics,
    free_port,
    quiet_trainer,
    run_two_ranks,
)
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


DIFFERING = {  # each rank's value of the settings its monitor was given
    "corrections": (["token_truncate:2.0"], []),
    "max_groups": (8, 1000),
    "log_strata": (True, False),
    "diagnose": (True, False),
    "log_every_n_steps": (1, 2),
}


def _differing_monitors(rank: int, port: int, out_dir: str) -> None:
    """One rank of a DDP fit whose monitors differ in ``DIFFERING`` (the processes are launched here, so
    Lightning does not spawn its own); saves the error it ended with."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    monitor = KLSampleTrainMonitor(log_worst_tokens=False, **{name: values[rank] for name, values in DIFFERING.items()})
    strategy = DDPStrategy(timeout=timedelta(seconds=20))  # gloo's default, 30 minutes, if the check were missing
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=2, callbacks=[monitor])
    result: dict[str, Any] = {}
    try:
        trainer.fit(TinyPolicy())
    except Exception as error:  # noqa: BLE001 - the test reads it
        result = {"error": f"{type(error).__name__}: {error}", "steps": trainer.global_step}
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_ranks_whose_monitors_differ_fail_together_at_setup_naming_each_setting(tmp_path: Path) -> None:
    results = run_two_ranks(_differing_monitors, (free_port(), str(tmp_path)), tmp_path, "monitors that differ")
    for result in results:  # every rank, before any step
        message = result.get("error", "")
        assert message.startswith("RanksDisagreeError: KLSampleTrainMonitor: the ranks' monitors have"), message
        assert result["steps"] == 0
        said = {**{name: tuple(map(repr, values)) for name, values in DIFFERING.items()},
                "corrections": ("['token_truncate(clip_max=2.0)']", "[]")}  # by their log names
        for name, (rank0, rank1) in said.items():
            assert f"{name}: rank 0: {rank0}, rank 1: {rank1}" in message, message
    assert results[0]["error"] == results[1]["error"]
