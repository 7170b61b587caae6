"""The divergence by sampling server (``sampler_server``: one URL per datum): a server behind is named by URL,
the others read current; the sums merge exactly across micro-batches and ranks at a fixed size."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.monitor import MediaOptions
from loops_callbacks.divergence.batch import MAX_SERVERS
from loops_callbacks.divergence.statistics import DivergenceStats
from tests.helpers import quiet_trainer, reduce_in_threads

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def fleet_step(step: int, *, behind: dict[str, int], seed: int = 0, n: int = 8, length: int = 24) -> dict[str, Any]:
    """A step sampled by two servers, datums alternating A, B; a server ``behind`` steps behind samples from
    weights that far off (its logprobs noised in proportion), the others at the trainer's."""
    generator = torch.Generator().manual_seed(seed + step)
    trainer = -torch.rand(n, length, generator=generator, dtype=torch.float64).mul(4.0).float()
    servers = [A if i % 2 == 0 else B for i in range(n)]
    lag = torch.tensor([behind.get(url, 0) for url in servers])
    noise = torch.randn(n, length, generator=generator) * 0.05 * lag[:, None]
    return {"logprobs": (trainer + noise).clamp(max=0.0), "training_logprobs": trainer,
            "mask": torch.ones(n, length), "policy_version": step - lag, "sampler_server": servers}


class FleetModule(pl.LightningModule):
    def __init__(self, behind: dict[str, int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.behind = behind

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.arange(8), batch_size=None)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {"loss": self.weight * 0.0, **fleet_step(self.global_step, behind=self.behind)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(behind: dict[str, int], steps: int = 3) -> KLSampleTrainMonitor:
    monitor = KLSampleTrainMonitor(log_every_n_steps=1, media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=steps, callbacks=[monitor]).fit(FleetModule(behind))
    return monitor


def test_a_server_behind_is_named_by_its_url_from_its_first_lagged_step_and_the_other_reads_current() -> None:
    monitor = run({B: 2})
    found = monitor.last_diagnosis
    assert found.cause == "stale" and found.is_observation, found.message
    assert f"server {B} (2 steps behind)" in found.message and f"{A} current" in found.message, found.message
    assert found.numbers["stale_servers"] == 1.0
    assert found.numbers["k3_stale_servers"] > 100 * found.numbers["k3_current_servers"]
    metrics = monitor.last_metrics
    prefix = monitor.prefix
    assert metrics[prefix + "server/0/lag_max"] == 0.0 and metrics[prefix + "server/1/lag_max"] == 2.0
    assert metrics[prefix + "server/0/n_action_tokens"] == metrics[prefix + "server/1/n_action_tokens"] == 4 * 24
    assert monitor.servers == [A, B]


def test_servers_in_step_with_the_trainer_are_not_stale() -> None:
    monitor = run({})
    assert monitor.last_diagnosis.cause != "stale", monitor.last_diagnosis.message
    assert monitor.last_metrics[monitor.prefix + "server/1/lag_max"] == 0.0


def test_the_servers_sums_merge_exactly_across_micro_batches_and_ranks() -> None:
    step = fleet_step(5, behind={B: 3})
    slots = torch.tensor([0 if url == A else 1 for url in step["sampler_server"]])

    def stats(rows: slice) -> DivergenceStats:
        flat = flatten_padded(sampler_logprobs=step["logprobs"][rows], training_logprobs=step["training_logprobs"][rows],
                              mask=step["mask"][rows])
        flat = dataclasses.replace(flat, servers=slots[rows], lags=5 - step["policy_version"][rows])
        return DivergenceStats.from_batch(flat)

    whole = stats(slice(None)).to_host()
    halves = [stats(slice(0, 3)), stats(slice(3, None))]
    merged = halves[0].merge(halves[1]).to_host()
    reduced = reduce_in_threads(halves)[0].to_host()
    for host in (merged, reduced):
        np.testing.assert_allclose(host.arrays["server_sums"], whole.arrays["server_sums"], rtol=1e-12)
        assert host.arrays["server_sums"].shape == (2 + 6, MAX_SERVERS)  # the same size whatever the servers
    by_lag = whole.arrays["server_sums"][2:]  # datums per lag bucket (0, 1, 2, 3, 4-7, 8+) and server
    assert by_lag[0].tolist() == [4, 0, 0, 0, 0, 0, 0, 0] and by_lag[3].tolist() == [0, 4, 0, 0, 0, 0, 0, 0]


def test_a_sampler_server_that_is_not_one_url_per_datum_is_one_warning_and_training_goes_on() -> None:
    class Broken(FleetModule):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            return super().training_step(batch, batch_idx) | {"sampler_server": [A]}

    monitor = KLSampleTrainMonitor(log_every_n_steps=1)
    with pytest.warns(UserWarning, match=r"'sampler_server' is a list of 1, not one server URL \(str\) per datum "
                                         r"for a micro-batch of 8 datums"):
        quiet_trainer(max_steps=2, callbacks=[monitor]).fit(Broken({}))
    assert not any("server/" in key for key in monitor.last_metrics)


def test_a_server_far_behind_is_said_by_its_lag_bucket() -> None:
    """Per server the lags travel as datums per lag bucket (a sum: constant bytes per rank); 5 reads 4-7."""
    found = run({A: 5, B: 1}, steps=6).last_diagnosis
    assert f"servers {A} (4-7 steps behind), {B} (1 step behind) sampled" in found.message, found.message
    assert "lag min 1, lag max 5" in found.message  # the step's exact lags beside them
