"""``val/dpo_*`` under DDP (two gloo ranks): the metrics of every held-out pair, not rank 0's half.

The held-out pairs are split across the ranks into batches of different sizes (and, with a sampler
that does not pad, into different numbers of pairs per rank); the logged values must equal
``dpo_loss`` over all the pairs at once, as one process computes them. Every case validates in one
pair of processes and one process group (``ddp_results``), started once for the module.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from loops_callbacks.demo.dpo import DPOPolicyModule
from loops_callbacks.models import dpo_loss
from tests.helpers import free_port, quiet_trainer, run_two_ranks

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:.*LeafSpec"),
]

LENGTH, VOCAB, BETA = 8, 12, 0.5
METRICS = ("dpo_loss", "dpo_accuracy", "dpo_margin", "chosen_reward", "rejected_reward")


class Pairs(Dataset):
    """Pair i: chosen and rejected rows ``[2, LENGTH]`` with a completion of its own length and
    made-up reference logprobs (so that some margins are positive and some negative)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + index)
        tokens = torch.randint(1, VOCAB, (2, LENGTH + 1), generator=generator)
        weights = torch.zeros(2, LENGTH)
        weights[:, 2 : 3 + index % (LENGTH - 3)] = 1.0
        return {
            "input_ids": tokens[:, :-1],
            "target_tokens": tokens[:, 1:],
            "weights": weights,
            "ref_logprobs": -3.0 * torch.rand(2, LENGTH, generator=generator),
        }


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows interleaved: 2i chosen, 2i + 1 rejected."""
    return {key: torch.cat([item[key] for item in items]) for key in items[0]}


class HeldOut(DPOPolicyModule):
    """The demo DPO policy validating ``pairs`` held-out pairs in batches of ``batch_size``.

    ``pad=False`` shards them with a sampler that never repeats a pair (ranks then hold different
    numbers of pairs); otherwise Lightning's own ``DistributedSampler`` shards them.
    """

    def __init__(self, pairs: int, batch_size: int, pad: bool = True) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=LENGTH, beta=BETA)
        self.pairs, self.batch_size, self.pad = pairs, batch_size, pad

    def val_dataloader(self) -> DataLoader:
        dataset = Pairs(self.pairs)
        sampler = None
        if not self.pad:
            world_size, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = UnrepeatedDistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate)


def one_batch_metrics(module: HeldOut, indices: list[int]) -> dict[str, float]:
    """``dpo_loss``'s metrics over the pairs ``indices`` in one batch, outside Lightning."""
    batch = collate([Pairs(module.pairs)[i] for i in indices])
    with torch.no_grad():
        policy = module.policy_logprobs(batch)
    _, metrics = dpo_loss(policy, batch["ref_logprobs"], batch["weights"], BETA)
    return {f"val/{name}": float(value) for name, value in metrics.items()}


def validate(module: HeldOut, **trainer_kwargs: Any) -> dict[str, float]:
    (results,) = quiet_trainer(**trainer_kwargs).validate(module, verbose=False)
    return {key: float(value) for key, value in results.items()}


def assert_metrics_close(got: dict[str, float], want: dict[str, float]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


CASES = [
    (10, 3, True),  # Lightning's DistributedSampler: 5 pairs per rank, batches of 3 and 2
    (9, 2, False),  # no padding: 5 pairs on rank 0 (batches 2, 2, 1), 4 on rank 1 (2, 2)
]


def _validate_every_case(rank: int, port: int, out: str) -> None:
    """One rank: each case's validation by a Trainer with DDP in this process group; the results in rank<r>.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        results = {case: validate(HeldOut(*case), strategy=DDPStrategy(timeout=timedelta(seconds=60)), devices=2)
                   for case in CASES}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[tuple[int, int, bool], dict[str, float]]]:
    """What each rank's Trainer returned for each case, ``[rank 0's, rank 1's]``."""
    out = tmp_path_factory.mktemp("dpo_val_ddp")
    return run_two_ranks(_validate_every_case, (free_port(), str(out)), Path(out), "the DDP validations")


@pytest.mark.parametrize(("pairs", "batch_size", "pad"), CASES)
def test_two_ranks_log_the_metrics_of_every_held_out_pair(
    pairs: int, batch_size: int, pad: bool, ddp_results: list[dict[tuple[int, int, bool], dict[str, float]]]
) -> None:
    module = HeldOut(pairs, batch_size, pad)
    want = one_batch_metrics(module, list(range(pairs)))
    rank_zero_half = one_batch_metrics(module, list(range(0, pairs, 2)))
    for key in ("val/dpo_loss", "val/dpo_accuracy"):  # the halves differ, so only a reduction can pass
        assert abs(rank_zero_half[key] - want[key]) > 1e-3, key
    assert 0.0 < want["val/dpo_accuracy"] < 1.0

    assert_metrics_close(validate(module), want)  # one process, batches of different sizes
    for results in ddp_results:  # every rank logs the metrics of all the pairs
        assert_metrics_close(results[pairs, batch_size, pad], want)
