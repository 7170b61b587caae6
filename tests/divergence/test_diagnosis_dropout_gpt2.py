"""A user's plain Hugging Face GPT-2, left in train mode with its default dropout 0.1, trained in a
tiny Lightning loop against a bf16 sampler synced every step: the monitor names dropout, never "stale"."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.diagnosis import DROPOUT
from loops_callbacks.divergence.monitor import MediaOptions
from tests.helpers import quiet_trainer

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, COMPLETION, ROWS = 64, 6, 10, 16


class Prompts(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(1, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(index))


class GPT2Policy(pl.LightningModule):
    """GPT-2 from a small config (dropout 0.1 by default); a bf16 copy samples, synced before every step."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )
        self.model = transformers.GPT2LMHeadModel(config)

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Completions drawn from the bf16 sampler (weights of this step), with its logprobs."""
        sampler = copy.deepcopy(self.model).to(torch.bfloat16).eval()
        ids, logprobs = prompts, []
        for _ in range(COMPLETION):
            logits = sampler(ids).logits[:, -1].float()
            step = torch.log_softmax(logits, -1)
            token = torch.multinomial(step.exp(), 1)
            logprobs.append(step.gather(-1, token))
            ids = torch.cat([ids, token], dim=1)
        return ids, torch.cat(logprobs, dim=1)

    def training_step(self, prompts: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        ids, completion_logprobs = self.sample(prompts)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.float32)
        mask[:, PROMPT - 1 :] = 1.0
        sampler = torch.zeros_like(mask)
        sampler[:, PROMPT - 1 :] = completion_logprobs
        trainer = torch.log_softmax(self.model(inputs).logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -(trainer * mask).sum() / mask.sum()
        return {"loss": loss, "training_logprobs": trainer, "logprobs": sampler, "mask": mask, "target_tokens": targets}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Prompts(), batch_size=ROWS)


def causes_of(dropout: float, steps: int = 8) -> tuple[KLSampleTrainMonitor, list[str]]:
    pl.seed_everything(0, verbose=False)
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_histogram=False, log_worst_tokens=False), log_every_n_steps=1)
    quiet_trainer(max_steps=steps, callbacks=[monitor]).fit(GPT2Policy(dropout))
    counts = monitor.history.causes
    return monitor, [cause for cause, (steps, _) in counts.items() for _ in range(steps)]


def test_dropout_left_on_in_a_plain_gpt2_is_named_and_never_called_stale() -> None:
    monitor, causes = causes_of(dropout=0.1)
    assert len(causes) == 8 and set(causes) == {DROPOUT}, causes
    message = monitor.last_diagnosis.message
    assert message.startswith("likely cause: observed: the trainer's logprobs include dropout noise: ")
    assert "Dropout modules with p = 0.1 are in training mode" in message and "model.eval()" in message
    [line] = [line for line in monitor.summary_lines() if line.startswith("  last diagnosis")]
    assert "observed, confidence 1.00" in line


def test_the_same_gpt2_without_dropout_is_not_called_dropout_or_stale() -> None:
    _, causes = causes_of(dropout=0.0)
    assert DROPOUT not in causes and "stale" not in causes, causes
