"""``DPODataModule``: preference pairs from files, data sets or memory, reference logprobs attached before training."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch import nn
from torch.utils.data import DataLoader, Subset
from typing_extensions import override

from loops_callbacks.data.dpo import DPOPairDataset, collate_dpo_pairs
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.data.sources import read_preference_records, relative_path_note
from loops_callbacks.data.records_across_ranks import tokenize_across_ranks
from loops_callbacks.data.reference_mixin import ReferenceLogprobsMixin
from loops_callbacks.data.tokenization import TokenizationReport, check_limits
from loops_callbacks.data.tokenizer import check_tokenizer_path
from loops_callbacks.reference.clients import SamplingClient
from loops_callbacks.distributed import ProcessGroup, StallGuard, fail_together
from loops_callbacks.reference.config import DEFAULT_SCORING_TIMEOUT, ScoringDtype
from loops_callbacks.validation import check, check_bool, check_int, check_real

__all__ = ["DPODataModule", "Scoring"]


@dataclass(frozen=True)
class Scoring:
    """How a local reference is run while its logprobs are scored: ``DPODataModule``'s ``scoring``, one group in a
    YAML config. Each field is ``ReferenceConfig``'s of that name, checked there.

    Example::

        scoring:
          scoring_dtype: bfloat16       # default: the model's own dtype
          max_tokens_per_batch: 8192    # padded tokens per forward pass
          scoring_timeout: 1200         # seconds a rank waits for the others (null: no limit)
    """

    scoring_dtype: ScoringDtype | None = None
    max_tokens_per_batch: int | None = None
    reference_fingerprint: str | None = None
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT


class DPODataModule(ReferenceLogprobsMixin, LightningDataModule):
    """Interleaved DPO pairs with reference logprobs, in batches that never split a pair.

    The pairs come from exactly one of:

    - ``path``: a ``.jsonl``, ``.json`` or ``.parquet`` file of preference records;
    - ``dataset``: ``datasets.load_dataset`` arguments (``path``, ``name``, ``split``,
      ``data_files``, ``data_dir``, ``revision``);
    - ``data``: a list of records, a ``datasets.Dataset``, or a list of interleaved datums (chosen
      at even indices, rejected at odd, in the Loops DPO convention of ``dpo_pair_datums``);
    - ``jsonl_path``: the same as ``path`` (kept for existing configs).

    Records may be in any of TRL's formats, found per record (see
    ``loops_callbacks.data.preference``): standard ``{"prompt", "chosen", "rejected"}`` strings,
    conversational lists of ``{"role", "content"}`` messages, an implicit prompt (full ``chosen``
    and ``rejected`` only), or token ids::

        {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
        {"chosen": [full token ids], "rejected": [full token ids], "prompt_length": 5}

    Text and chat records are tokenized once, in ``setup("fit")``, with ``tokenizer`` (default:
    the LightningModule's ``tokenizer_name_or_path``, as ``HFDPOModule`` has), exactly as TRL's
    ``DPOTrainer`` tokenizes them (see ``loops_callbacks.data.tokenization``), within
    ``max_length`` (keeps the start; pairs whose prompt fills it are dropped) and
    ``max_prompt_length`` (keeps the end of a long prompt). What was truncated or dropped is
    counted in ``tokenization_report`` and said in one warning. Changing the tokenizer or a limit
    changes the token ids, and so the reference cache's key: the pairs are scored again.

    In ``setup("fit")`` the data are then checked; their reference logprobs are loaded from the
    cache or scored (see ``ReferenceLogprobsMixin``) then for an explicit reference, and for the
    default one, the LightningModule itself (the initial policy, no copy), in ``on_fit_start``:
    after the strategy has set the module up, before any dataloader and the first optimizer step. Its ``forward(input_ids)`` must return logits. A resumed run takes them from the cache.
    Batches (``collate_dpo_pairs``) hold ``batch_size`` pairs as ``[2P, T]`` tensors
    ``input_ids``, ``target_tokens``, ``weights``, ``ref_logprobs``, ``attention_mask``, rows
    interleaved (2i chosen, 2i + 1 rejected) and right-padded with 0 / False. The dataset's items
    are pairs, so Lightning's ``DistributedSampler`` shards pairs across ranks.

    Args:
        data: records, a ``datasets.Dataset``, or interleaved datums.
        jsonl_path: a JSONL file of records (same as ``path``).
        path: a ``.jsonl``, ``.json`` or ``.parquet`` file of records (a relative path is taken from
            the working directory; one that does not exist is a ``ValueError`` when the module is made).
        dataset: ``datasets.load_dataset`` arguments, e.g. ``{"path": "json", "data_files": "pairs.jsonl",
            "split": "train"}``.
        tokenizer: a Hugging Face tokenizer, or its name/path for ``AutoTokenizer.from_pretrained`` (a
            path that does not exist is a ``ValueError`` when the module is made).
        max_length: longest prompt + completion, in tokens.
        max_prompt_length: longest prompt, in tokens (less than ``max_length``).
        batch_size: pairs per batch.
        reference: a checkpoint path (Lightning ``.ckpt`` or a state dict of the LightningModule),
            an ``nn.Module``, a ``SamplingClient``, or ``None`` for the initial policy.
        cache_dir: the cache's directory (default ``<trainer.default_root_dir>/reference_logprobs``).
        use_cache: ``False`` scores on every run and writes nothing.
        shuffle: shuffle the training pairs each epoch (Lightning's ``DistributedSampler`` takes
            over under DDP and seeds itself from ``seed_everything``).
        seed: seed of the shuffling and of the validation split.
        num_workers: ``DataLoader`` workers.
        val_fraction: share of the pairs held out for ``val_dataloader`` (0: no validation; the
            Trainer's validation loop is then switched off, ``limit_val_batches = 0``).
        progress: progress bars on rank 0 while tokenizing and scoring.
        scoring: how the reference is run (``Scoring``): ``scoring_dtype``, the dtype of a local
            reference while scoring (default: the model's own); ``max_tokens_per_batch``, its
            padded-token budget per forward pass; ``reference_fingerprint``, the identity of a client
            whose weights cannot be hashed here, so that its logprobs can be cached;
            ``scoring_timeout``, the seconds a rank waits for the others at each step of reading,
            tokenizing and scoring before every waiting rank names the ones that stalled
            (``RankStalledError``; ``None``: no limit, the backend's own timeout).

    Under DDP each rank reads the records, the ranks check that they read the same records with
    the same tokenizer and limits (else a ``RanksDisagreeError`` on every rank names the first
    differing pair and where each rank read it), and each rank tokenizes 1/world_size of them;
    all get every pair (``loops_callbacks.data.records_across_ranks``).

    Example::

        # config.yaml (LightningCLI)
        data:
          class_path: loops_callbacks.data.DPODataModule
          init_args:
            path: data/pairs.jsonl          # or dataset: {path: trl-lib/ultrafeedback_binarized, split: train}
            tokenizer: Qwen/Qwen2.5-0.5B-Instruct
            max_length: 1024
            max_prompt_length: 512
            batch_size: 16
            reference: checkpoints/sft.ckpt   # omit for the initial policy
            scoring:
              scoring_dtype: bfloat16
    """

    def __init__(self, data: list | Any = None, jsonl_path: str | None = None, batch_size: int = 8,
                 reference: str | nn.Module | SamplingClient | None = None, cache_dir: str | None = None,
                 use_cache: bool = True, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 val_fraction: float = 0.0, progress: bool = True, path: str | None = None,
                 dataset: dict[str, Any] | None = None, tokenizer: str | Any = None, max_length: int | None = None,
                 max_prompt_length: int | None = None, scoring: Scoring = Scoring()) -> None:
        super().__init__()
        given = [name for name, value in (("data", data), ("path", path), ("dataset", dataset),
                                          ("jsonl_path", jsonl_path)) if value is not None]
        if len(given) != 1:
            raise ValueError("DPODataModule needs exactly one of data, path, dataset and jsonl_path, got "
                             f"{' and '.join(given) if given else 'neither'}")
        if data is not None and (isinstance(data, (str, bytes, Mapping)) or not hasattr(data, "__len__")):
            hint = " (a file goes in path=, load_dataset arguments in dataset=)" if isinstance(data, (str, Mapping)) else ""
            raise TypeError(f"DPODataModule data must be a list of datums or records, or a datasets.Dataset, got "
                            f"{type(data).__name__}{hint}")
        name = "path" if path is not None else "jsonl_path"
        file = check(f"DPODataModule {name}", path if path is not None else jsonl_path, (str, os.PathLike), "a path",
                     optional=True)
        check("DPODataModule dataset", dataset, Mapping, "load_dataset arguments (a dict)", optional=True)
        if dataset is not None and "path" not in dataset:
            raise ValueError(f"DPODataModule dataset={dataset!r} must be load_dataset arguments with a 'path', e.g. "
                             "{'path': 'json', 'data_files': 'pairs.jsonl', 'split': 'train'}")
        check("DPODataModule scoring", scoring, Scoring, "a Scoring (scoring_dtype, max_tokens_per_batch, ...)")
        check_int("DPODataModule batch_size", batch_size, least=1)
        check_int("DPODataModule num_workers", num_workers, least=0)
        check_limits(max_length, max_prompt_length, "DPODataModule ")
        check_int("DPODataModule seed", seed, least=None)
        check_bool("DPODataModule shuffle", shuffle)
        check_real("DPODataModule val_fraction", val_fraction, least=0.0, most=math.nextafter(1.0, 0.0),
                   what="a number in [0, 1)")
        self.configure_reference(reference, cache_dir=cache_dir, use_cache=use_cache, progress=progress,
                                 **asdict(scoring))
        self.data = list(data) if isinstance(data, (list, tuple)) else data
        self.path = os.fspath(file) if file is not None else None
        if not ProcessGroup().distributed:  # ranks already in a group meet a missing file together, when they read it
            if self.path is not None and not os.path.lexists(self.path):
                raise ValueError(f"DPODataModule {name}={self.path!r} does not exist{relative_path_note(self.path)}")
            if isinstance(tokenizer, (str, os.PathLike)):
                check_tokenizer_path(os.fspath(tokenizer), "DPODataModule tokenizer")
        self.jsonl_path = self.path if jsonl_path is not None else None
        self.dataset = dict(dataset) if dataset is not None else None
        self.tokenizer = tokenizer
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.batch_size, self.shuffle, self.seed, self.num_workers = batch_size, shuffle, seed, num_workers
        self.val_fraction = float(val_fraction)
        self.tokenization_report: TokenizationReport | None = None
        self._read: list[Any] | PackedPairs | None = None  # dpo_data(), read once
        self._train: list[int] | None = None
        self._val: list[int] | None = None

    @override
    def dpo_data(self) -> list[Any] | PackedPairs:
        """The given datums, or the records read and tokenized straight into the packed form (once; no datum made).

        With an initialized ``torch.distributed`` group every rank must call it (``setup`` does):
        the ranks compare what they read and share the tokenizing.
        """
        if self._read is None:
            self._read = self._given_datums()
            if self._read is None:
                source = next(s for s in (self.path, self.dataset, self.data) if s is not None)
                guard = StallGuard(ProcessGroup(), self.reference_config.scoring_timeout)
                with fail_together(guard, "reading the preference records",
                                   then="the end of reading the preference records"):
                    records = read_preference_records(source)
                self._read, self.tokenization_report = tokenize_across_ranks(
                    records, self._tokenizer_source(), max_length=self.max_length,
                    max_prompt_length=self.max_prompt_length, progress=self.reference_config.progress,
                    timeout=self.reference_config.scoring_timeout)
        return self._read

    def _given_datums(self) -> list[Any] | None:
        """``data`` when it is a list of datums, ``None`` when the data are records (an error when it mixes both)."""
        if not isinstance(self.data, list):
            return None
        is_record = [isinstance(item, Mapping) and "chosen" in item for item in self.data]
        if not any(is_record):
            return self.data
        if not all(is_record):
            first = is_record.index(not is_record[0])
            raise ValueError(f"DPODataModule data mixes records and datums (item 0 is "
                             f"{'a record' if is_record[0] else 'a datum'}, item {first} is not); give one kind")
        return None

    def _tokenizer_source(self) -> Any:
        """``tokenizer``, else the LightningModule's ``tokenizer_name_or_path`` (``HFDPOModule``), else ``None``."""
        if self.tokenizer is not None:
            return self.tokenizer
        trainer = getattr(self, "trainer", None)
        module = trainer.lightning_module if trainer is not None else None
        return getattr(module, "tokenizer_name_or_path", None)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        # the split; with the default reference the logprobs come in on_fit_start (ReferenceLogprobsMixin)
        num_pairs = self.num_dpo_pairs
        num_val = max(1, round(num_pairs * self.val_fraction)) if self.val_fraction > 0 else 0
        if num_val >= num_pairs:
            raise ValueError(f"DPODataModule val_fraction={self.val_fraction} of {num_pairs} pairs leaves no "
                             "training pairs")
        order = np.random.default_rng(self.seed).permutation(num_pairs)
        self._val = sorted(order[:num_val].tolist())
        self._train = sorted(order[num_val:].tolist())
        if num_val == 0 and self.trainer is not None:
            # no held-out pairs: no validation loop at all (Lightning warns about an empty val loader)
            self.trainer.limit_val_batches = 0

    @override
    def train_dataloader(self) -> DataLoader:
        """The training pairs (after ``setup("fit")``: before it, reading ``scored_pairs`` says so)."""
        return self._loader(self._train, shuffle=self.shuffle)

    @override
    def val_dataloader(self) -> DataLoader | list:
        """The held-out pairs (``val_fraction``), or no loader when there are none (before ``setup("fit")``, reading
        ``scored_pairs`` says so)."""
        return [] if self._val == [] else self._loader(self._val, shuffle=False, unrepeated=True)

    def _loader(self, indices: list[int], *, shuffle: bool, unrepeated: bool = False) -> DataLoader:
        """Batches of the pairs ``indices`` (shuffled from ``seed``); ``unrepeated``: under DDP each held-out pair
        goes to one rank once.

        Lightning's own ``DistributedSampler`` pads every rank to the same count by repeating up
        to world size - 1 pairs, which would count twice in ``val/*``; with fewer pairs than ranks
        it is kept (Lightning refuses a rank without a batch).
        """
        subset = Subset(DPOPairDataset(self.scored_pairs), indices)
        trainer = getattr(self, "trainer", None)
        sampler = None
        if unrepeated and trainer is not None and 1 < trainer.world_size <= len(indices):
            sampler = UnrepeatedDistributedSampler(subset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                                   shuffle=False)
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(subset, batch_size=self.batch_size, shuffle=shuffle, sampler=sampler, generator=generator,
                          collate_fn=collate_dpo_pairs, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)
