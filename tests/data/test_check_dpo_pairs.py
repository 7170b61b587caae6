"""The DPO pairs are read once and checked every time: ``check_dpo_pairs`` reads datums into one ``PackedPairs``
and checks it in vectorized passes, the reference mixin keeps that one form from setup to the batches, and pairs
given packed (replaced, edited in place, built on checked pairs) fail as a fresh check of the same data does."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loops_callbacks.data import DPODataModule, DPOPairDataset, ReferenceLogprobsMixin, check_dpo_pairs, dpo_pair_datums
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.types import Datum, ModelInput, TensorData
from tests.data.test_data import VOCAB, CountingClient, make_pairs, pair_datums, ref_values


class ReadCountingDatum(Datum):
    """A datum that counts how often its ``model_input`` is read."""

    reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "model_input":
            type(self).reads += 1
        return super().__getattribute__(name)


class _Base:
    """What ``LightningDataModule.setup`` is to the mixin (nothing)."""

    def setup(self, stage: str) -> None:
        pass


class Mixed(ReferenceLogprobsMixin, _Base):
    """The mixin over the given datums, set up by hand (no trainer)."""

    def __init__(self, data: list[Any], reference: Any) -> None:
        super().__init__()
        self.data = data
        self.configure_reference(reference, use_cache=False, progress=False)

    def dpo_data(self) -> list[Any]:
        return self.data


def torch_reference() -> TorchSamplingClient:
    torch.manual_seed(0)
    return TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)))


def test_check_dpo_pairs_packs_what_the_datums_hold_in_one_pass() -> None:
    data = pair_datums(make_pairs(4))
    pairs = check_dpo_pairs(data)
    assert isinstance(pairs, PackedPairs) and pairs.ref_logprobs is None and pairs.without_weights == ()
    expected = PackedPairs.from_datums(attach_reference_logprobs(data, CountingClient()))
    for key in ("input_ids", "target_tokens", "weights", "offsets"):
        assert np.array_equal(getattr(pairs, key), getattr(expected, key)), key
    assert check_dpo_pairs(pairs) is pairs and pairs.source is data


def test_the_mixin_reads_each_datum_once_and_keeps_one_packed_form() -> None:
    data = [ReadCountingDatum(d.model_input, d.loss_fn_inputs) for d in pair_datums(make_pairs(3))]
    ReadCountingDatum.reads = 0
    module = Mixed(data, torch_reference())
    module.setup("fit")
    pairs = module.scored_pairs
    DPOPairDataset(pairs)
    assert ReadCountingDatum.reads == len(data)  # setup's one pass; the batches read the packed form
    kept = pairs.source  # the user's own datums, by reference (datums() attaches the values to them)
    assert kept is not None and all(a is b for a, b in zip(kept, data)) and module.scored_pairs is pairs
    scored = pairs.datums()
    assert [d.model_input.to_ints() for d in scored] == [d.model_input.to_ints() for d in data]
    assert ref_values(scored) == [pairs.row(i)["ref_logprobs"].tolist() for i in range(len(pairs))]


def test_datums_without_weights_are_scored_and_named_when_batched() -> None:
    data = [Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in pair_datums(make_pairs(2))]
    module = Mixed(data, CountingClient())
    module.setup("fit")
    scored = module.scored_pairs.datums()
    assert all("weights" not in d.loss_fn_inputs for d in scored)
    assert ref_values(scored) == ref_values(attach_reference_logprobs(data, CountingClient()))
    with pytest.raises(ValueError, match=r"pair 0: the chosen datum \(index 0\) has no 'weights'"):
        DPOPairDataset(module.scored_pairs)


def test_a_client_that_scores_datums_gets_the_users_own_model_inputs() -> None:
    data = pair_datums(make_pairs(2))
    seen: list[Any] = []

    class Remote(CountingClient):
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            seen.append(prompt)
            return super().compute_logprobs(prompt)

    module = Mixed(data, Remote())
    module.setup("fit")
    assert [id(p) for p in seen] == [id(d.model_input) for d in data]


def test_the_checks_name_the_datum() -> None:
    chosen, rejected = pair_datums(make_pairs(1))
    bad = Datum(rejected.model_input, {**rejected.loss_fn_inputs, "weights": TensorData([0.0, 1.0], "float32", [2])})
    with pytest.raises(ValueError, match=r"'weights' has 2 values for a model_input of"):
        check_dpo_pairs([chosen, bad])
    last = Datum(ModelInput.from_ints([1, 2]), {"weights": TensorData([0.0, 1.0], "float32", [2])})
    with pytest.raises(ValueError, match=r"pair 0: the rejected datum \(index 1\) carries weight on the last"):
        check_dpo_pairs([chosen, last])


LAST_WEIGHTED = r"pair 0: the rejected datum \(index 1\) carries weight on the last"
PROMPTS_DIFFER = r"pair 0: the chosen \(datum 0\) and rejected \(datum 1\) prompts differ"


def as_datums(pairs: PackedPairs) -> list[Datum]:
    """New datums of what the arrays hold (not the datums the pairs were read from)."""
    return dataclasses.replace(pairs, source=None).datums()


def fresh_error(pairs: PackedPairs) -> str:
    """The message of checking ``pairs``' data anew, as datums (``check_dpo_pairs``)."""
    with pytest.raises(ValueError) as raised:
        check_dpo_pairs(as_datums(pairs))
    return str(raised.value)


def assert_checked_like_fresh(pairs: PackedPairs, pattern: str) -> None:
    expected = fresh_error(pairs)
    with pytest.raises(ValueError, match=pattern) as raised:
        check_dpo_pairs(pairs)
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
    assert check_dpo_pairs(pairs, check_prompts=False) is pairs
    with pytest.raises(ValueError, match=PROMPTS_DIFFER):
        check_dpo_pairs(pairs, check_prompts=True)


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
    assert outcome(check_dpo_pairs, pairs) == outcome(check_dpo_pairs, as_datums(pairs))


class EditedPairs(DPODataModule):
    """A user's ``dpo_data()`` that builds on the DataModule's checked pairs, with a weight on a last position."""

    def dpo_data(self) -> PackedPairs:
        pairs = check_dpo_pairs(super().dpo_data())
        return dataclasses.replace(pairs, weights=weighted_last(pairs))


def test_a_dpo_data_override_built_on_the_checked_pairs_is_checked() -> None:
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
