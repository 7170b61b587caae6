"""``PackedPairs``: the one packed form batches are cut from; datums are read once, values not copied."""

from __future__ import annotations

import numpy as np
import pytest

from loops_callbacks.data import DPOPairDataset, collate_dpo_pairs, dpo_pair_datums
from loops_callbacks.data.packed_pairs import PackedPairs


def scored_pairs() -> tuple[list, np.ndarray]:
    data = [*dpo_pair_datums([1, 2, 3], [1, 4], 1), *dpo_pair_datums([5, 6, 7, 8], [5, 6, 9], 2)]
    values = np.arange(sum(d.model_input.length for d in data), dtype=np.float32) / -10
    return PackedPairs.from_datums(data).scored(values).datums(), values


def test_the_dataset_holds_one_packed_form_whose_values_are_the_scored_buffer() -> None:
    data, values = scored_pairs()
    dataset = DPOPairDataset(data)
    assert isinstance(dataset.packed, PackedPairs) and dataset.packed.offsets.tolist() == [0, 3, 5, 9, 12]
    assert np.shares_memory(dataset.packed.ref_logprobs, values)  # not copied
    assert dataset.packed.input_ids.tolist() == [1, 2, 3, 1, 4, 5, 6, 7, 8, 5, 6, 9]
    # the same batches from the packed form and from the datums
    again = DPOPairDataset(dataset.packed)
    for key, tensor in collate_dpo_pairs([dataset[0], dataset[1]]).items():
        assert tensor.tolist() == collate_dpo_pairs([again[0], again[1]])[key].tolist(), key


def test_values_that_are_not_one_buffer_are_copied_once_and_a_missing_field_names_the_datum() -> None:
    data, _ = scored_pairs()
    for datum in data:
        datum.loss_fn_inputs["ref_logprobs"] = datum.loss_fn_inputs["ref_logprobs"].tolist()
    packed = PackedPairs.from_datums(data)
    assert packed.ref_logprobs.dtype == np.float32 and len(packed.ref_logprobs) == 12
    del data[3].loss_fn_inputs["weights"]
    assert PackedPairs.from_datums(data).without_weights == (3,)
    with pytest.raises(ValueError, match=r"pair 1: the rejected datum \(index 3\) has no 'weights'"):
        DPOPairDataset(data)
    del data[2].loss_fn_inputs["ref_logprobs"]
    with pytest.raises(ValueError, match=r"pair 1: the chosen datum \(index 2\) has no 'ref_logprobs' .attach them"):
        PackedPairs.from_datums(data)
    with pytest.raises(IndexError):
        DPOPairDataset(PackedPairs.from_datums(data[:2]))[1]
