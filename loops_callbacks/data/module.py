"""``DPODataModule``: preference pairs from memory or JSONL, reference logprobs attached before training."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import nn
from torch.utils.data import DataLoader, Subset
from typing_extensions import override

from loops_callbacks.data.dpo import DPOPairDataset, collate_dpo_pairs, dpo_records_to_datums, read_dpo_jsonl
from loops_callbacks.data.reference_mixin import ReferenceLogprobsMixin, ScoringDtype
from loops_callbacks.reference.clients import SamplingClient

__all__ = ["DPODataModule"]


class DPODataModule(ReferenceLogprobsMixin, LightningDataModule):
    """Interleaved DPO pairs with reference logprobs, in batches that never split a pair.

    The pairs come from ``data`` (a ``list`` of interleaved datums, chosen at even indices and
    rejected at odd, in the Loops DPO convention of ``dpo_pair_datums``; or a list of records as
    below) or from ``jsonl_path``, a file of one record per line::

        {"chosen": [full token ids], "rejected": [full token ids], "prompt_length": 5}
        {"chosen": [...], "rejected": [...], "chosen_weights": [...], "rejected_weights": [...]}

    In ``setup("fit")`` the data are checked and their reference logprobs loaded from the cache or
    scored (see ``ReferenceLogprobsMixin``); the default reference is a frozen copy of the
    LightningModule at that moment (the initial policy), so its ``forward(input_ids)`` must
    return logits. Batches (``collate_dpo_pairs``) hold ``batch_size`` pairs as ``[2P, T]`` tensors
    ``input_ids``, ``target_tokens``, ``weights``, ``ref_logprobs``, ``attention_mask``, rows
    interleaved (2i chosen, 2i + 1 rejected) and right-padded with 0 / False. The dataset's items
    are pairs, so Lightning's ``DistributedSampler`` shards pairs across ranks.

    Args:
        data: interleaved datums, or records (one per pair); give this or ``jsonl_path``.
        jsonl_path: a JSONL file of records; give this or ``data``.
        batch_size: pairs per batch.
        reference: a checkpoint path (Lightning ``.ckpt`` or a state dict of the LightningModule),
            an ``nn.Module``, a ``SamplingClient``, or ``None`` for the initial policy.
        cache_dir: the cache's directory (default ``<trainer.default_root_dir>/reference_logprobs``).
        use_cache: ``False`` scores on every run and writes nothing.
        scoring_dtype: dtype of a local reference while scoring (default: the model's own).
        max_tokens_per_batch: padded-token budget per forward pass of a local reference.
        shuffle: shuffle the training pairs each epoch (Lightning's ``DistributedSampler`` takes
            over under DDP and seeds itself from ``seed_everything``).
        seed: seed of the shuffling and of the validation split.
        num_workers: ``DataLoader`` workers.
        val_fraction: share of the pairs held out for ``val_dataloader`` (0: no validation).
        reference_fingerprint: identity of a client whose weights cannot be hashed here, so that
            its logprobs can be cached.
        progress: a progress bar on rank 0 while scoring.

    Example::

        # config.yaml (LightningCLI)
        data:
          class_path: loops_callbacks.data.DPODataModule
          init_args:
            jsonl_path: data/pairs.jsonl
            batch_size: 16
            reference: checkpoints/sft.ckpt   # omit for the initial policy
            scoring_dtype: bfloat16
    """

    def __init__(
        self,
        data: list | None = None,
        jsonl_path: str | None = None,
        batch_size: int = 8,
        reference: str | nn.Module | SamplingClient | None = None,
        cache_dir: str | None = None,
        use_cache: bool = True,
        scoring_dtype: ScoringDtype | None = None,
        max_tokens_per_batch: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        val_fraction: float = 0.0,
        reference_fingerprint: str | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if (data is None) == (jsonl_path is None):
            raise ValueError(
                f"DPODataModule needs exactly one of data and jsonl_path, got "
                f"{'both' if data is not None else 'neither'} (jsonl_path={jsonl_path!r})"
            )
        if data is not None and not isinstance(data, (list, tuple)):
            raise ValueError(f"DPODataModule data must be a list of datums or records, got {type(data).__name__}")
        if jsonl_path is not None and not isinstance(jsonl_path, (str, os.PathLike)):
            raise ValueError(f"DPODataModule jsonl_path={jsonl_path!r} must be a path")
        for name, value, low in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DPODataModule {name}={value!r} must be an int >= {low}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"DPODataModule seed={seed!r} must be an int")
        if not isinstance(shuffle, bool):
            raise ValueError(f"DPODataModule shuffle={shuffle!r} must be a bool")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ValueError(f"DPODataModule val_fraction={val_fraction!r} must be a number in [0, 1)")
        self.configure_reference(
            reference,
            cache_dir=cache_dir,
            use_cache=use_cache,
            scoring_dtype=scoring_dtype,
            max_tokens_per_batch=max_tokens_per_batch,
            reference_fingerprint=reference_fingerprint,
            progress=progress,
        )
        self.data = list(data) if data is not None else None
        self.jsonl_path = os.fspath(jsonl_path) if jsonl_path is not None else None
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self.val_fraction = float(val_fraction)
        self._train: Subset | None = None
        self._val: Subset | None = None

    @override
    def dpo_data(self) -> list[Any]:
        """The interleaved datums, from ``jsonl_path`` or ``data`` (records become pairs)."""
        if self.jsonl_path is not None:
            return read_dpo_jsonl(self.jsonl_path)
        assert self.data is not None
        is_record = [isinstance(item, Mapping) and "chosen" in item for item in self.data]
        if all(is_record):
            return dpo_records_to_datums(self.data)
        if any(is_record):
            first = is_record.index(not is_record[0])
            raise ValueError(
                f"DPODataModule data mixes records and datums (item 0 is {'a record' if is_record[0] else 'a datum'}, "
                f"item {first} is not); give one kind"
            )
        return list(self.data)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        dataset = DPOPairDataset(self.scored_data)
        order = np.arange(len(dataset))
        num_val = 0
        if self.val_fraction > 0:
            num_val = max(1, round(len(dataset) * self.val_fraction))
            if num_val >= len(dataset):
                raise ValueError(
                    f"DPODataModule val_fraction={self.val_fraction} of {len(dataset)} pairs leaves no training pairs"
                )
            order = np.random.default_rng(self.seed).permutation(len(dataset))
        self._val = Subset(dataset, sorted(order[:num_val].tolist()))
        self._train = Subset(dataset, sorted(order[num_val:].tolist()))

    @override
    def train_dataloader(self) -> DataLoader:
        if self._train is None:
            raise RuntimeError("DPODataModule.train_dataloader needs setup('fit') first (trainer.fit calls it)")
        generator = torch.Generator().manual_seed(self.seed) if self.shuffle else None
        return self._loader(self._train, shuffle=self.shuffle, generator=generator)

    @override
    def val_dataloader(self) -> DataLoader | list:
        """The held-out pairs (``val_fraction``), or no loader when there are none."""
        if self._val is None:
            raise RuntimeError("DPODataModule.val_dataloader needs setup('fit') first (trainer.fit calls it)")
        return self._loader(self._val, shuffle=False, generator=None) if len(self._val) else []

    def _loader(self, dataset: Subset, *, shuffle: bool, generator: torch.Generator | None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=collate_dpo_pairs,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
