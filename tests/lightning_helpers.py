"""A tiny policy whose sampler logprobs differ from its trainer logprobs by a known amount.

Every micro-batch it trains on is recorded, so tests can recompute the monitor's numbers with
``loops_compute_kl_sample_train`` on exactly the same tokens.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from loops_callbacks import loops_compute_kl_sample_train
from loops_callbacks.types import Datum, ModelInput

VOCAB, LENGTH = 16, 12


class TokenDataset(Dataset):
    """Item i: a deterministic token row, an action mask, sampler noise and an advantage."""

    def __init__(self, size: int = 64) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, VOCAB, (LENGTH + 1,), generator=generator)
        mask = (torch.arange(LENGTH) >= 3 + index % 4).float()
        return {
            "input_ids": tokens[:-1],
            "target_tokens": tokens[1:],
            "mask": mask,
            "noise": 0.1 * torch.randn(LENGTH, generator=generator),
            "advantages": torch.tensor(float(index % 3 - 1) if index % 5 else 0.5),
        }


class TinyPolicy(pl.LightningModule):
    """Trainer logprobs from a tiny LM; sampler logprobs = trainer + noise + ``offset``."""

    def __init__(self, offset: float = 0.0, lr: float = 0.05, manual: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.offset = offset
        self.lr = lr
        self.automatic_optimization = not manual
        self.recorded: list[dict[str, Any]] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self(batch["input_ids"]).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, batch["target_tokens"][..., None]).squeeze(-1)
        sampler = logprobs.detach().float() + batch["noise"] + self.offset
        loss = -(logprobs * batch["mask"] * batch["advantages"][:, None]).sum() / batch["mask"].sum()
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.recorded.append(
            {
                "step": self.trainer.fit_loop.epoch_loop._batches_that_stepped,
                "sampler": sampler.double().cpu(),
                "trainer": logprobs.detach().double().cpu(),
                "mask": batch["mask"].cpu(),
                "advantages": batch["advantages"].cpu(),
                "input_ids": batch["input_ids"].cpu(),
                "target_tokens": batch["target_tokens"].cpu(),
            }
        )
        return {"loss": loss, "training_logprobs": logprobs, "logprobs": sampler}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(), batch_size=4, shuffle=False)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))


def datums_of(records: list[dict[str, Any]]) -> tuple[list[Datum], list[torch.Tensor]]:
    """The recorded micro-batches as Loops datums (concatenated in order) and trainer rows."""
    datums, trainer = [], []
    for record in records:
        for row in range(record["sampler"].shape[0]):
            datums.append(
                Datum(
                    ModelInput.from_ints(record["input_ids"][row].tolist()),
                    {
                        "logprobs": record["sampler"][row],
                        "mask": record["mask"][row],
                        "advantages": record["advantages"][row : row + 1],
                        "target_tokens": record["target_tokens"][row],
                    },
                )
            )
            trainer.append(record["trainer"][row])
    return datums, trainer


def expected_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    return loops_compute_kl_sample_train(*datums_of(records))


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, logger=False, log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class CleanDistributedExit(pl.Callback):
    """Destroys the process group when a spawned rank exits.

    Lightning destroys it in an ``atexit`` handler, which ``ddp_spawn`` workers never run (they
    leave through ``os._exit``); a gloo group left alive can abort the worker at exit.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and multiprocessing.parent_process() is not None:
            multiprocessing.util.Finalize(None, _destroy_process_group, exitpriority=100)
