"""Packed DPO pairs are checked every time they reach the reference mixin (``check_packed_pairs``), even when
``check_dpo_pairs`` made them: a ``dataclasses.replace`` of checked pairs, an in-place edit of their arrays and a
changed prompt each give the same ``ValueError`` as a fresh check of the same data (``check_dpo_pairs`` on their
datums), and so does a DataModule whose ``dpo_pairs()`` builds on ``super().dpo_pairs()``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.data import DPODataModule, PackedPairs, check_dpo_pairs, dpo_pair_datums
from loops_callbacks.data.dpo import check_packed_pairs
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.types import Datum, ModelInput, TensorData
from tests.data.test_data import VOCAB, make_pairs, pair_datums

LAST_WEIGHTED = r"pair 0: the rejected datum \(index 1\) carries weight on the last"
PROMPTS_DIFFER = r"pair 0: the chosen \(datum 0\) and rejected \(datum 1\) prompts differ"


def torch_reference() -> TorchSamplingClient:
    """A reference that scores the packed pairs (``score_packed``), so the mixin reads ``dpo_pairs()``."""
    torch.manual_seed(0)
    return TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)))


def fresh_error(pairs: PackedPairs) -> str:
    """The message of checking ``pairs``' data anew, as datums (``check_dpo_pairs``)."""
    with pytest.raises(ValueError) as raised:
        check_dpo_pairs(pairs.datums())
    return str(raised.value)


def assert_checked_like_fresh(pairs: PackedPairs, pattern: str) -> None:
    expected = fresh_error(pairs)
    with pytest.raises(ValueError, match=pattern) as raised:
        check_packed_pairs(pairs)
    assert str(raised.value) == expected


def weighted_last(pairs: PackedPairs) -> np.ndarray:
    """``pairs``' weights (a copy) with a weight on datum 1's last position (Tinker's convention)."""
    weights = pairs.weights.copy()
    weights[pairs.offsets[2] - 1] = 1.0
    return weights


def test_replaced_weights_of_checked_pairs_are_checked() -> None:
    checked = check_dpo_pairs(pair_datums(make_pairs(2)))
    assert_checked_like_fresh(dataclasses.replace(checked, weights=weighted_last(checked)), LAST_WEIGHTED)


def test_checked_pairs_edited_in_place_are_checked() -> None:
    checked = check_dpo_pairs(pair_datums(make_pairs(2)))
    checked.weights[checked.offsets[2] - 1] = 1.0
    assert_checked_like_fresh(checked, LAST_WEIGHTED)


def test_a_changed_prompt_of_checked_pairs_is_checked() -> None:
    checked = check_dpo_pairs(pair_datums(make_pairs(2)))
    ids = checked.input_ids.copy()
    ids[checked.offsets[1]] = ids[checked.offsets[1]] % (VOCAB - 1) + 1  # another token, still in the vocabulary
    assert_checked_like_fresh(dataclasses.replace(checked, input_ids=ids), PROMPTS_DIFFER)


def test_pairs_checked_without_their_prompts_are_checked_when_the_prompts_count() -> None:
    chosen, _ = dpo_pair_datums([1, 2, 3], [1, 4], 1)
    _, other = dpo_pair_datums([7, 2, 3], [7, 4], 1)
    pairs = check_dpo_pairs([chosen, other], check_prompts=False)
    assert check_packed_pairs(pairs, check_prompts=False) is pairs
    with pytest.raises(ValueError, match=PROMPTS_DIFFER):
        check_packed_pairs(pairs, check_prompts=True)


def test_a_part_of_checked_pairs_is_checked() -> None:
    pairs = check_dpo_pairs(pair_datums(make_pairs(2)))
    assert check_packed_pairs(pairs.head(2)).offsets.tolist() == pairs.offsets[:3].tolist()
    with pytest.raises(ValueError, match=r"odd number of datums \(3\)"):
        check_packed_pairs(pairs.head(3))


@st.composite
def sequence_weights(draw: st.DrawFn, length: int) -> list[float] | None:
    """Weights of a sequence of ``length`` tokens, none on the last position: a prompt's shape (zeros, then
    weights), all zeros, a gap in the weights, or none at all (a datum without ``weights``)."""
    kind = draw(st.sampled_from(["prompt", "prompt", "prompt", "zeros", "gap", "none"]))
    if kind == "none":
        return None
    weights = [0.0] * length
    if kind != "zeros" and length > 1:
        first = draw(st.integers(0, length - 2))
        weights[first : length - 1] = [draw(st.sampled_from([0.5, 1.0, 2.0]))] * (length - 1 - first)
        if kind == "gap":
            weights[draw(st.integers(first, length - 2))] = 0.0
    return weights


@st.composite
def packed_pairs(draw: st.DrawFn) -> PackedPairs:
    """A few pairs whose two sequences mostly share a prompt, sometimes not, by tokens or by weights."""
    datums = []
    for _ in range(draw(st.integers(1, 5))):
        prompt = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
        sequences = [prompt + draw(st.lists(st.integers(1, 3), max_size=3)) for _ in range(2)]
        if draw(st.booleans()):  # the rejected prompt changed at one token
            index = draw(st.integers(0, len(prompt) - 1))
            sequences[1][index] = sequences[1][index] % 3 + 1
        for tokens in sequences:
            weights = draw(sequence_weights(len(tokens)))
            inputs = {"target_tokens": TensorData(tokens[1:] + [0], "int64", [len(tokens)])}
            if weights is not None:
                inputs["weights"] = TensorData(weights, "float32", [len(tokens)])
            datums.append(Datum(ModelInput.from_ints(tokens), inputs))
    return check_dpo_pairs(datums, check_prompts=False)


def outcome(check: Any, data: Any) -> str:
    try:
        check(data)
    except ValueError as error:
        return str(error)
    return "passed"


@settings(max_examples=300, deadline=None)
@given(packed_pairs())
def test_packed_pairs_pass_or_fail_their_prompt_check_as_their_datums_do(pairs: PackedPairs) -> None:
    assert outcome(check_packed_pairs, pairs) == outcome(check_dpo_pairs, pairs.datums())


class EditedPairs(DPODataModule):
    """A user's ``dpo_pairs()`` that builds on the DataModule's checked pairs, with a weight on a last position."""

    def dpo_pairs(self) -> PackedPairs:
        pairs = super().dpo_pairs()
        return dataclasses.replace(pairs, weights=weighted_last(pairs))


def test_a_dpo_pairs_override_built_on_the_checked_pairs_is_checked() -> None:
    data = EditedPairs(pair_datums(make_pairs(2)), reference=torch_reference(), use_cache=False, progress=False)
    with pytest.raises(ValueError, match=LAST_WEIGHTED):
        data.setup("fit")


def test_a_bad_given_datum_is_still_named() -> None:
    chosen, rejected = dpo_pair_datums([1, 2, 3], [1, 4, 5], 1)
    rejected.loss_fn_inputs["weights"].data[-1] = 1.0  # Tinker's convention: a weight on the last position
    data = DPODataModule([chosen, rejected], reference=torch_reference(), use_cache=False, progress=False)
    with pytest.raises(ValueError, match=LAST_WEIGHTED):
        data.setup("fit")
    odd = DPODataModule([chosen], reference=torch_reference(), use_cache=False, progress=False)
    with pytest.raises(ValueError, match=r"odd number of datums \(1\)"):
        odd.setup("fit")
