"""The reference mixin keeps the scored values as one buffer: ``scored_pairs`` (the packed form batches are cut
from) holds it as it is, and datums (``scored_pairs.datums()``) are made only when a user asks for them: the
user's own, every field of theirs kept."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loops_callbacks.data import DPODataModule
import loops_callbacks.data.packed_pairs as packed_pairs
from loops_callbacks.data.packed_pairs import FIELDS, PackedPairs
from tests.data.test_data import CountingClient, fit, make_pairs, pair_datums, ref_values, toy_model


def scored_module(**kwargs: Any) -> DPODataModule:
    data = DPODataModule(pair_datums(make_pairs(5)), reference=CountingClient(), use_cache=False, progress=False,
                         batch_size=2, **kwargs)
    data.setup("fit")
    return data


def test_scored_pairs_hold_the_scored_buffer_and_the_values_their_datums_show() -> None:
    data = scored_module()
    pairs = data.scored_pairs
    assert isinstance(pairs, PackedPairs) and len(pairs) == 10 and pairs.ref_logprobs.dtype == np.float32
    from_datums = PackedPairs.from_datums(pairs.datums())
    assert np.shares_memory(from_datums.ref_logprobs, pairs.ref_logprobs)  # the datums' values: views of it
    for key in (*FIELDS, "offsets"):
        assert np.array_equal(getattr(pairs, key), getattr(from_datums, key)), key
    assert ref_values(pairs.datums()) == [pairs.row(i)["ref_logprobs"].tolist() for i in range(len(pairs))]


def test_no_datum_is_made_for_the_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    data = DPODataModule([{"chosen": c, "rejected": r, "prompt_length": k} for c, r, k in make_pairs(5)],
                         reference=CountingClient(), use_cache=False, progress=False, batch_size=2)

    def no_datum(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a datum was made")

    monkeypatch.setattr(packed_pairs, "Datum", no_datum)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert sum(batch["input_ids"].shape[0] for batch in batches) == 10


def test_a_fit_trains_on_the_same_batches(tmp_path: Any) -> None:
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False, use_cache=False, shuffle=False)
    fit(toy_model(1), data, tmp_path, max_steps=1)
    batch = next(iter(data.train_dataloader()))
    expected = PackedPairs.from_datums(data.scored_pairs.datums())
    assert batch["ref_logprobs"][0, : int(expected.offsets[1])].tolist() == expected.row(0)["ref_logprobs"].tolist()


def test_scored_pairs_before_setup_names_setup() -> None:
    with pytest.raises(RuntimeError, match=r"scored_pairs is computed in setup\('fit'\)"):
        _ = DPODataModule(pair_datums(make_pairs(2)), progress=False).scored_pairs


def with_extra_field(datums: list[Any]) -> list[Any]:
    """The datums with a field of the user's own in each (the SDK's datums carry whatever the user puts there)."""
    from loops_callbacks.types import Datum

    return [
        Datum(d.model_input, {**d.loss_fn_inputs, "advantages": np.full(d.model_input.length, 0.5, np.float32)})
        for d in datums
    ]


def test_the_datums_of_scored_pairs_keep_every_field_of_the_datums_the_user_gave() -> None:
    """They are the user's datums with ref_logprobs attached, not datums rebuilt from the packed form."""
    from loops_callbacks.data import ReferenceLogprobsMixin
    from lightning.pytorch import LightningDataModule

    given = with_extra_field(pair_datums(make_pairs(3)))
    module = DPODataModule(given, reference=CountingClient(), use_cache=False, progress=False, batch_size=2)
    module.setup("fit")

    class Own(ReferenceLogprobsMixin, LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.configure_reference(CountingClient(), use_cache=False, progress=False)

        def dpo_data(self) -> list[Any]:
            return given

    own = Own()
    own.setup("fit")
    for data in (module, own):
        scored = data.scored_pairs.datums()
        assert len(scored) == len(given)
        for before, after in zip(given, scored):
            assert set(after.loss_fn_inputs) == set(before.loss_fn_inputs) | {"ref_logprobs"}
            assert np.array_equal(after.loss_fn_inputs["advantages"], before.loss_fn_inputs["advantages"])
        assert all("ref_logprobs" not in d.loss_fn_inputs for d in given)  # the user's datums are not modified
        assert ref_values(scored) == [data.scored_pairs.row(i)["ref_logprobs"].tolist() for i in range(len(given))]
