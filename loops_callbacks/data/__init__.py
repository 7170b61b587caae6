"""DPO data for Lightning: the Loops pair convention and DataModules that attach reference logprobs.

- ``dpo``: the Loops DPO datum convention (``dpo_pair_datums``), JSONL records, checks, batches;
- ``packed_pairs``: ``PackedPairs``, the pairs back to back in flat arrays, which batches are cut from;
- ``preference``: preference records from files, data sets and memory, in TRL's formats;
- ``tokenization``: text and chat records to datums as TRL's ``DPOTrainer`` tokenizes them
  (``preference_datums``), within ``max_length`` / ``max_prompt_length``;
- ``reference_mixin``: ``ReferenceLogprobsMixin`` for any DataModule, and
  ``compute_reference_logprobs`` (checks the pairs, then scores them with ``loops_callbacks.reference``);
- ``module``: ``DPODataModule``, ready for LightningCLI.

The scoring itself (clients, resolving a ``reference`` setting, the cache, the cross-rank
computation) lives in ``loops_callbacks.reference``; its names are re-exported here, as is
``from_tinker_convention`` (``loops_callbacks.conventions``), which turns datums in Tinker's
convention into Loops ones.

Example (your own DataModule)::

    class MyData(ReferenceLogprobsMixin, L.LightningDataModule):
        def __init__(self, reference: str | None = None, cache_dir: str | None = None):
            super().__init__()
            self.configure_reference(reference, cache_dir=cache_dir)

        def dpo_data(self):  # interleaved: chosen at even indices, rejected at odd
            return [d for c, r, k in my_pairs for d in dpo_pair_datums(c, r, prompt_length=k)]

        def train_dataloader(self):
            return DataLoader(DPOPairDataset(self.scored_pairs), batch_size=8, collate_fn=collate_dpo_pairs)
"""

from loops_callbacks.conventions import from_tinker_convention
from loops_callbacks.data.dpo import (
    DPOPairDataset,
    check_dpo_pairs,
    check_vocabulary,
    collate_dpo_pairs,
    dpo_pair_datums,
    dpo_records_to_datums,
    validate_dpo_pairs,
)
from loops_callbacks.data.module import DPODataModule
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.data.preference import read_preference_records
from loops_callbacks.data.reference_mixin import ReferenceConfig, ReferenceLogprobsMixin, compute_reference_logprobs
from loops_callbacks.data.tokenization import (
    PreferenceDataWarning,
    TokenizationReport,
    preference_datums,
    preference_pairs,
    read_dpo_jsonl,
)
from loops_callbacks.reference.across_ranks import ReferenceCacheError, ReferenceCacheWarning, ReferenceLogprobsReport
from loops_callbacks.reference.collectives import RankStalledError
from loops_callbacks.reference.rank_agreement import RanksDisagreeError
from loops_callbacks.reference.cache import CacheKey, data_fingerprint, read_cache, write_cache
from loops_callbacks.reference.resolve import load_reference_checkpoint, resolve_reference

__all__ = [
    "CacheKey",
    "DPODataModule",
    "DPOPairDataset",
    "PackedPairs",
    "PreferenceDataWarning",
    "RankStalledError",
    "RanksDisagreeError",
    "ReferenceCacheError",
    "ReferenceCacheWarning",
    "ReferenceConfig",
    "ReferenceLogprobsMixin",
    "ReferenceLogprobsReport",
    "TokenizationReport",
    "check_dpo_pairs",
    "check_vocabulary",
    "collate_dpo_pairs",
    "compute_reference_logprobs",
    "data_fingerprint",
    "dpo_pair_datums",
    "dpo_records_to_datums",
    "from_tinker_convention",
    "load_reference_checkpoint",
    "preference_datums",
    "preference_pairs",
    "read_cache",
    "read_dpo_jsonl",
    "read_preference_records",
    "resolve_reference",
    "validate_dpo_pairs",
    "write_cache",
]
