"""Tokenized records go straight into the packed form: ``preference_pairs`` makes no datum, ``DPODataModule`` gives
its pairs packed through the ``dpo_data()`` hook, and datums are made of them only on request."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import loops_callbacks.data.packed_pairs as packed_pairs
from loops_callbacks.data import (
    DPODataModule,
    PackedPairs,
    ReferenceLogprobsMixin,
    check_dpo_pairs,
    preference_pairs,
)
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.clients import TorchSamplingClient
from tests.data.test_data import CountingClient, make_pairs, ref_values
from tests.data.test_preference_data import RECORDS, TOKENIZER_PATH

KEYS = ("input_ids", "target_tokens", "weights", "offsets")


def records() -> list[dict[str, Any]]:
    return [{"chosen": c, "rejected": r, "prompt_length": k} for c, r, k in make_pairs(5)] + RECORDS["conversational"]


def same_arrays(one: PackedPairs, other: PackedPairs) -> bool:
    return all(np.array_equal(getattr(one, key), getattr(other, key)) for key in KEYS)


def test_preference_pairs_make_no_datum_and_their_datums_check_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_datum(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a datum was made")

    with monkeypatch.context() as patch:
        patch.setattr(packed_pairs, "Datum", no_datum)
        pairs, report = preference_pairs(records(), TOKENIZER_PATH, max_length=64, progress=False)
    assert same_arrays(pairs, check_dpo_pairs(pairs.datums())) and pairs.ref_logprobs is None
    assert report.num_pairs == len(pairs) // 2 == 7


def test_the_datamodule_gives_its_packed_pairs_to_the_mixin_and_datums_on_request() -> None:
    torch.manual_seed(0)
    reference = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(1024, 8), torch.nn.Linear(8, 1024)))
    data = DPODataModule(records(), tokenizer=TOKENIZER_PATH, max_length=64, reference=reference,
                         use_cache=False, progress=False, batch_size=2)
    data.setup("fit")
    given = data.dpo_data()
    assert data.scored_pairs.input_ids is given.input_ids  # the one packed form, not a copy
    expected = preference_pairs(records(), TOKENIZER_PATH, max_length=64, progress=False)[0].datums()
    datums = data.dpo_data().datums()
    assert [d.model_input.to_ints() for d in datums] == [d.model_input.to_ints() for d in expected]
    assert [d.loss_fn_inputs["weights"].data for d in datums] == [d.loss_fn_inputs["weights"].data for d in expected]
    assert ref_values(data.scored_pairs.datums()) == ref_values(attach_reference_logprobs(expected, reference))


def test_a_client_that_scores_datums_gets_the_datamodules_datums() -> None:
    data = DPODataModule(records(), tokenizer=TOKENIZER_PATH, max_length=64, reference=CountingClient(vocab_size=None),
                         use_cache=False, progress=False, batch_size=2)
    data.setup("fit")
    expected = preference_pairs(records(), TOKENIZER_PATH, max_length=64, progress=False)[0].datums()
    assert ref_values(data.scored_pairs.datums()) == ref_values(attach_reference_logprobs(expected, CountingClient()))


class PackedOnly(ReferenceLogprobsMixin):
    """A DataModule that gives only packed pairs (set up by hand, no trainer)."""

    def __init__(self, pairs: PackedPairs) -> None:
        super().__init__()
        self.pairs = pairs
        self.configure_reference(CountingClient(fingerprint=None), use_cache=False, progress=False)

    def dpo_data(self) -> PackedPairs:
        return self.pairs


class _Base:
    """What ``LightningDataModule.setup`` is to the mixin (nothing)."""

    def setup(self, stage: str) -> None:
        pass


class PackedOnlyModule(PackedOnly, _Base):
    pass


def test_a_datamodule_whose_dpo_data_are_packed_is_scored_from_them() -> None:
    pairs, _ = preference_pairs([{"chosen": [1, 2, 3], "rejected": [1, 4], "prompt_length": 1},
                                 {"chosen": [5, 6], "rejected": [5, 7, 8], "prompt_length": 1}], progress=False)
    module = PackedOnlyModule(pairs)
    module.setup("fit")
    assert module.num_dpo_pairs == 2 and module.scored_pairs.input_ids is pairs.input_ids
    expected = attach_reference_logprobs(pairs.datums(), CountingClient())
    assert ref_values(module.scored_pairs.datums()) == ref_values(expected)
