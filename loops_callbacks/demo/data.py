"""Demo data: prompt batches for RL, and token-level preference pairs for DPO.

- ``PromptDataModule`` yields ``{"prompt_ids": LongTensor[P, L]}`` batches of
  ``ReverseDigitsTask`` prompts for ``RLPolicyModule`` (infinite, or ``num_batches`` per epoch).
- ``make_preference_pairs`` builds ``(chosen, rejected, prompt_length)`` pairs from the task:
  chosen = prompt + the correct completion, rejected = prompt + a corrupted one.
- ``write_preference_jsonl`` stores those pairs as records
  ``{"chosen": [ids], "rejected": [ids], "prompt_length": k}``, the format
  ``loops_callbacks.data.DPODataModule(jsonl_path=...)`` reads; in memory,
  ``loops_callbacks.data.dpo_pair_datums(chosen, rejected, prompt_length)`` turns a pair into
  datums.

Examples:
    >>> from loops_callbacks.demo.tasks import ReverseDigitsTask
    >>> task = ReverseDigitsTask(num_digits=3)
    >>> chosen, rejected, prompt_length = make_preference_pairs(task, 1, seed=0)[0]
    >>> task.tokenizer.decode(chosen[:prompt_length]) == task.tokenizer.decode(rejected[:prompt_length])
    True
    >>> task.reward(chosen[:prompt_length], chosen[prompt_length:]), len(chosen) == len(rejected)
    (1.0, True)
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence

import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from loops_callbacks.data.module import DPODataModule
from loops_callbacks.demo.tasks import ReverseDigitsTask
from loops_callbacks.validation import check, check_int

PreferencePair = tuple[list[int], list[int], int]
"""``(chosen full ids, rejected full ids, prompt_length)``; both sequences start with the same prompt."""


class PromptBatches(IterableDataset):
    """Batches ``{"prompt_ids": LongTensor[batch_size, prompt_length]}`` of task prompts.

    Every iteration starts again from ``seed``, so a sized dataset (``num_batches``) repeats the
    same prompts each epoch and an infinite one (``num_batches=None``) never repeats in practice.
    """

    def __init__(self, task: ReverseDigitsTask, batch_size: int, num_batches: int | None, seed: int) -> None:
        self.task = task
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.seed = seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in itertools.count() if self.num_batches is None else range(self.num_batches):
            yield {"prompt_ids": self.task.sample_prompts(self.batch_size, generator)}

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an infinite PromptBatches (num_batches=None) has no length")
        return self.num_batches


class PromptDataModule(LightningDataModule):
    """Prompt batches of ``ReverseDigitsTask`` for ``RLPolicyModule``.

    Args:
        num_digits: digits per prompt; must match the module's ``num_digits``.
        num_symbols: how many of the digits 0-9 prompts use.
        batch_size: prompts per batch (the module samples ``group_size`` completions of each).
        num_batches: batches per epoch; ``None`` (default) = an endless stream (set the trainer's
            ``max_steps``).
        seed: seed of the prompt stream; each process adds its global rank, so DDP ranks see
            different prompts.

    Examples:
        >>> datamodule = PromptDataModule(num_digits=3, batch_size=2, num_batches=5)
        >>> datamodule.setup("fit")
        >>> batch = next(iter(datamodule.train_dataloader()))
        >>> batch["prompt_ids"].shape, len(datamodule.train_dataloader())
        (torch.Size([2, 5]), 5)
    """

    def __init__(
        self,
        num_digits: PositiveInt = 4,
        num_symbols: int = 10,
        batch_size: PositiveInt = 16,
        num_batches: PositiveInt | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.task = ReverseDigitsTask(num_digits, num_symbols)
        self.batch_size = check_int("PromptDataModule batch_size", batch_size, least=1)
        self.num_batches = check_int("PromptDataModule num_batches", num_batches, least=1, optional=True)
        self.seed = seed

    @override
    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        dataset = PromptBatches(self.task, self.batch_size, self.num_batches, self.seed + rank)
        return DataLoader(dataset, batch_size=None)  # the dataset yields whole batches


def make_preference_pairs(
    task: ReverseDigitsTask, num_pairs: int, *, seed: int = 0, num_corrupted: int = 1
) -> list[PreferencePair]:
    """Token-level preference pairs: chosen = correct completion, rejected = ``num_corrupted`` digits changed.

    Both sequences are ``prompt + completion`` (completion ending in ``<eos>``) and have the same
    length; ``prompt_length`` is ``task.prompt_length``. A corrupted digit is replaced by a
    different digit of the task's symbols, so the rejected completion is always wrong.

    Examples:
        >>> task = ReverseDigitsTask(num_digits=4)
        >>> chosen, rejected, k = make_preference_pairs(task, 1, seed=1, num_corrupted=2)[0]
        >>> sum(a != b for a, b in zip(chosen, rejected)), k
        (2, 6)
    """
    check_int("make_preference_pairs num_pairs", num_pairs, least=0)
    check("make_preference_pairs num_corrupted", num_corrupted, int, f"an int in [1, num_digits={task.num_digits}]",
          lambda n: 1 <= n <= task.num_digits)
    generator = torch.Generator().manual_seed(seed)
    digit_ids = task.tokenizer.encode("0123456789"[: task.num_symbols])
    pairs: list[PreferencePair] = []
    for prompt in task.sample_prompts(num_pairs, generator).tolist():
        completion = task.target(prompt)
        corrupted = list(completion)
        for position in torch.randperm(task.num_digits, generator=generator)[:num_corrupted].tolist():
            others = [d for d in digit_ids if d != completion[position]]
            corrupted[position] = others[int(torch.randint(len(others), (), generator=generator))]
        pairs.append((prompt + completion, prompt + corrupted, len(prompt)))
    return pairs


def write_preference_jsonl(path: str | os.PathLike[str], pairs: Sequence[PreferencePair]) -> None:
    """Write one ``{"chosen": [...], "rejected": [...], "prompt_length": k}`` record per line.

    ``loops_callbacks.data.DPODataModule(jsonl_path=path)`` (or ``read_dpo_jsonl``) reads the file.
    """
    with open(path, "w", encoding="utf-8") as file:
        for chosen, rejected, prompt_length in pairs:
            record = {"chosen": list(chosen), "rejected": list(rejected), "prompt_length": prompt_length}
            file.write(json.dumps(record) + "\n")


class ReversePairsDataModule(DPODataModule):
    """DPO pairs of the reverse-digits task, made in memory: chosen is right, rejected has a wrong digit.

    A ``DPODataModule`` (reference logprobs attached before training, cached, sharded across
    ranks) whose data come from ``make_preference_pairs`` instead of a file.

    Examples:
        >>> data = ReversePairsDataModule(num_pairs=4, batch_size=2)
        >>> len(data.dpo_data())
        8
    """

    def __init__(
        self,
        num_pairs: PositiveInt = 1024,
        num_digits: PositiveInt = 4,
        num_symbols: PositiveInt = 10,
        num_corrupted: PositiveInt = 1,
        seed: int = 0,
        batch_size: PositiveInt = 32,
        reference: str | None = None,
        cache_dir: str | None = None,
        val_fraction: float = 0.0,
        progress: bool = True,
    ) -> None:
        task = ReverseDigitsTask(num_digits, num_symbols)
        pairs = make_preference_pairs(task, num_pairs, seed=seed, num_corrupted=num_corrupted)
        records = [{"chosen": c, "rejected": r, "prompt_length": k} for c, r, k in pairs]
        super().__init__(
            data=records, batch_size=batch_size, reference=reference, cache_dir=cache_dir, seed=seed,
            val_fraction=val_fraction, progress=progress,
        )
