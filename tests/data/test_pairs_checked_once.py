"""The given datums of the DPO pairs route are checked once: ``DPODataModule.dpo_pairs()`` reads them with
``check_dpo_pairs``, and the reference mixin does not check those pairs again (``check_packed_pairs``), with the
same errors as before; pairs made otherwise are still checked by the mixin."""

from __future__ import annotations

import pytest
import torch

import loops_callbacks.data.dpo as dpo
from loops_callbacks.data import DPODataModule, check_dpo_pairs, dpo_pair_datums
from loops_callbacks.data.dpo import check_packed_pairs
from loops_callbacks.reference.clients import TorchSamplingClient
from tests.data.test_data import VOCAB, make_pairs, pair_datums


def torch_reference() -> TorchSamplingClient:
    """A reference that scores the packed pairs (``score_packed``), so the mixin reads ``dpo_pairs()``."""
    torch.manual_seed(0)
    return TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)))


def counting_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the checks of a whole set of pairs (each starts with the count of datums)."""
    counts: list[int] = []
    check_count = dpo._check_count

    def counting(count: int) -> None:
        counts.append(count)
        check_count(count)

    monkeypatch.setattr(dpo, "_check_count", counting)
    return counts


def test_the_datamodules_given_datums_are_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = counting_checks(monkeypatch)
    data = DPODataModule(pair_datums(make_pairs(3)), reference=torch_reference(), use_cache=False, progress=False)
    data.setup("fit")
    assert counts == [6] and data.num_dpo_pairs == 3


def test_a_bad_given_datum_is_still_named(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen, rejected = dpo_pair_datums([1, 2, 3], [1, 4, 5], 1)
    rejected.loss_fn_inputs["weights"].data[-1] = 1.0  # Tinker's convention: a weight on the last position
    data = DPODataModule([chosen, rejected], reference=torch_reference(), use_cache=False, progress=False)
    with pytest.raises(ValueError, match=r"pair 0: the rejected datum \(index 1\) carries weight on the last"):
        data.setup("fit")
    odd = DPODataModule([chosen], reference=torch_reference(), use_cache=False, progress=False)
    with pytest.raises(ValueError, match=r"odd number of datums \(1\)"):
        odd.setup("fit")


def test_pairs_checked_without_their_prompts_are_checked_again_when_the_prompts_count() -> None:
    chosen, _ = dpo_pair_datums([1, 2, 3], [1, 4], 1)
    _, other = dpo_pair_datums([7, 2, 3], [7, 4], 1)
    pairs = check_dpo_pairs([chosen, other], check_prompts=False)
    assert check_packed_pairs(pairs, check_prompts=False) is pairs
    with pytest.raises(ValueError, match=r"pair 0: the chosen \(datum 0\) and rejected \(datum 1\) prompts differ"):
        check_packed_pairs(pairs, check_prompts=True)


def test_a_part_of_checked_pairs_is_checked_as_new(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = check_dpo_pairs(pair_datums(make_pairs(2)))
    counts = counting_checks(monkeypatch)
    check_packed_pairs(pairs.head(2))
    with pytest.raises(ValueError, match=r"odd number of datums \(3\)"):
        check_packed_pairs(pairs.head(3))
    assert counts == [2, 3]
