"""The DPO pairs are read once: ``check_dpo_pairs`` checks and packs them in one pass, and the reference mixin
keeps that one ``PackedPairs`` (not the datums) from setup to the batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from loops_callbacks.data import DPOPairDataset, ReferenceLogprobsMixin, check_dpo_pairs, validate_dpo_pairs
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
    assert validate_dpo_pairs(data) == [d.model_input.to_ints() for d in data]


def test_the_mixin_reads_each_datum_once_and_keeps_one_packed_form() -> None:
    data = [ReadCountingDatum(d.model_input, d.loss_fn_inputs) for d in pair_datums(make_pairs(3))]
    ReadCountingDatum.reads = 0
    module = Mixed(data, torch_reference())
    module.setup("fit")
    pairs = module.scored_pairs
    DPOPairDataset(pairs)
    assert ReadCountingDatum.reads == len(data)  # setup's one pass; the batches read the packed form
    kept = module._reference.datums  # the user's own datums, by reference (scored_data attaches the values to them)
    assert kept is not None and all(a is b for a, b in zip(kept, data)) and module.scored_pairs is pairs
    assert module.scored_pairs.ref_logprobs is module._reference.values
    scored = module.scored_data
    assert [d.model_input.to_ints() for d in scored] == [d.model_input.to_ints() for d in data]
    assert ref_values(scored) == [pairs.row(i)["ref_logprobs"].tolist() for i in range(len(pairs))]


def test_datums_without_weights_are_scored_and_named_when_batched() -> None:
    data = [Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in pair_datums(make_pairs(2))]
    module = Mixed(data, CountingClient())
    module.setup("fit")
    scored = module.scored_data
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
    assert module._reference.datums is not None  # kept by reference: scored_data attaches the values to them


def test_the_checks_name_the_datum() -> None:
    chosen, rejected = pair_datums(make_pairs(1))
    bad = Datum(rejected.model_input, {**rejected.loss_fn_inputs, "weights": TensorData([0.0, 1.0], "float32", [2])})
    with pytest.raises(ValueError, match=r"'weights' has 2 values for a model_input of"):
        check_dpo_pairs([chosen, bad])
    last = Datum(ModelInput.from_ints([1, 2]), {"weights": TensorData([0.0, 1.0], "float32", [2])})
    with pytest.raises(ValueError, match=r"pair 0: the rejected datum \(index 1\) carries weight on the last"):
        check_dpo_pairs([chosen, last])
