"""Every 2-rank check of the divergence tests, run in one pair of processes sharing one gloo process group.

Starting two processes (torch, Lightning, a process group) costs far more than the fits themselves,
so the ``two_rank_runs`` fixture (``conftest``) starts them once: each scenario below fits or reduces
in the same process group and saves what its test reads under ``<out>/<scenario>``; what a scenario
ended with is in ``<out>/rank<r>.pt``. The monitors that differ go last: they fail their fit at setup.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.distributed import ProcessGroup
from loops_callbacks.divergence.statistics import reduce_across_ranks
from loops_callbacks.divergence.monitor import MediaOptions
from tests.divergence import test_callback_ddp, test_correction_shadow, test_divergence_reduction
from tests.divergence import test_monitor_strata, test_nan_advantages
from tests.helpers import TinyPolicy, quiet_trainer, stats_of


def _trainer(**kwargs: Any) -> Any:
    return quiet_trainer(strategy=DDPStrategy(timeout=timedelta(seconds=60)), devices=2, **kwargs)


def global_batch(rank: int, out: Path) -> None:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    _trainer(max_steps=3, accumulate_grad_batches=2, logger=CSVLogger(str(out), name="csv", version=0),
             callbacks=[monitor, test_callback_ddp.MetricsPerRank(monitor, str(out))]
             ).fit(test_callback_ddp.RecordingPolicy(str(out)))


def strata_and_shadow(rank: int, out: Path) -> None:
    monitor = KLSampleTrainMonitor(
        media=MediaOptions(log_worst_tokens=False, max_groups=test_monitor_strata.MAX_GROUPS),
        corrections=test_monitor_strata.CORRECTIONS,
    )
    _trainer(max_steps=2, accumulate_grad_batches=2, logger=CSVLogger(str(out), name="csv", version=0),
             callbacks=[monitor]).fit(test_monitor_strata.VersionedPolicy(str(out)))


def nan_on_rank_one(rank: int, out: Path) -> None:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    _trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[monitor, test_nan_advantages.WarningsPerRank(str(out))]
             ).fit(test_nan_advantages.NanOnRank(str(out), nan_rank=1))


def no_advantages_on_rank_one(rank: int, out: Path) -> None:
    monitor = KLSampleTrainMonitor(
        media=MediaOptions(log_worst_tokens=False), diagnose=False, corrections=["off_policy_mask:100"])
    _trainer(max_steps=1, callbacks=[monitor, test_correction_shadow.SaidPerRank(str(out))]
             ).fit(test_correction_shadow.NoAdvantagesOnRankOne(str(out)))


def reductions(rank: int, out: Path) -> None:
    saved = {}
    for name, specs in test_divergence_reduction.SCENARIOS.items():
        for sample_size in (100_000, 7):
            stats = stats_of(test_divergence_reduction.synthetic_rows(*specs[rank]), top_n=5, sample_size=sample_size)
            collectives = test_divergence_reduction.CountingCollectives(ProcessGroup())
            result = reduce_across_ranks(stats, collectives, generator=torch.Generator().manual_seed(rank))
            saved[name, sample_size] = (result, collectives.calls)
    torch.save(saved, out / f"rank{rank}.pt")


SCENARIOS = {fit.__name__: fit for fit in (reductions, global_batch, strata_and_shadow, nan_on_rank_one,
                                           no_advantages_on_rank_one)}


def run_scenarios(rank: int, port: int, out: str) -> None:
    """One rank of every scenario, in one process group; then the monitors that differ (they fail at setup)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS.items():
            (Path(out) / name).mkdir(exist_ok=True)
            scenario(rank, Path(out) / name)
        differing = {name: values[rank] for name, values in test_callback_ddp.DIFFERING.items()}
        media = MediaOptions(log_worst_tokens=False, max_groups=differing.pop("max_groups"),
                             log_strata=differing.pop("log_strata"))
        trainer = _trainer(max_steps=2, callbacks=[KLSampleTrainMonitor(media=media, **differing)])
        try:
            trainer.fit(TinyPolicy())
        except Exception as error:  # noqa: BLE001 - the test reads it
            result = {"error": f"{type(error).__name__}: {error}", "steps": trainer.global_step}
    finally:
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()
