"""DPO data for Lightning: the Loops pair convention and DataModules that attach reference logprobs.

- ``dpo``: the Loops DPO convention (``dpo_pair_datums``), the checks (``check_dpo_pairs``), batches;
- ``packed_pairs``: ``PackedPairs``, the pairs back to back in flat arrays, from tokenization to the batches;
- ``sources``: preference records from files, data sets and memory; ``preference``: their format (TRL's);
- ``tokenizer``: loading it, and calling it as TRL does (``token_window``: a window of a very long record);
- ``tokenization``: records to pairs as TRL's ``DPOTrainer`` tokenizes them (``preference_pairs``),
  within ``max_length`` / ``max_prompt_length``;
- ``records_across_ranks``: the records compared across ranks, each rank tokenizing its share;
- ``reference_mixin``: ``ReferenceLogprobsMixin`` for any DataModule (the pairs checked once, then
  scored with ``loops_callbacks.reference``);
- ``module``: ``DPODataModule``, ready for LightningCLI.

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
from loops_callbacks.data.dpo import DPOPairDataset, check_dpo_pairs, collate_dpo_pairs, dpo_pair_datums
from loops_callbacks.data.module import DPODataModule, Scoring
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.data.sources import read_preference_records
from loops_callbacks.data.reference_mixin import ReferenceLogprobsMixin
from loops_callbacks.data.tokenization import PreferenceDataWarning, TokenizationReport, preference_pairs, read_dpo_jsonl
from loops_callbacks.reference.across_ranks import ReferenceCacheError, ReferenceCacheWarning, ReferenceLogprobsReport
from loops_callbacks.reference.config import ReferenceConfig

__all__ = [
    "DPODataModule", "DPOPairDataset", "PackedPairs", "PreferenceDataWarning", "ReferenceCacheError",
    "ReferenceCacheWarning", "ReferenceConfig", "ReferenceLogprobsMixin", "ReferenceLogprobsReport", "Scoring",
    "TokenizationReport", "check_dpo_pairs", "collate_dpo_pairs", "dpo_pair_datums", "from_tinker_convention",
    "preference_pairs", "read_dpo_jsonl", "read_preference_records",
]
