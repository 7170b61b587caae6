"""Token ids are checked once on their way to the reference: in ``score_across_ranks``, which hands the
scorers a checked form they do not read again (they still check ids given to them directly)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from loops_callbacks.data.dpo import OutOfVocabularyError, dpo_pair_datums
from loops_callbacks.data.reference_mixin import compute_reference_logprobs
from loops_callbacks.reference import packing
from loops_callbacks.reference.across_ranks import score_across_ranks
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.packing import CheckedTokens, PackedTokens, check_token_ids
from loops_callbacks.reference.policy import PolicyReference
from loops_callbacks.types import Datum, ModelInput

VOCAB = 16


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def pairs() -> list[Any]:
    return [*dpo_pair_datums([1, 2, 3], [1, 4], prompt_length=1), *dpo_pair_datums([5, 6, 7], [5, 9], prompt_length=1)]


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ids each pass over the ids (the vocabulary check) read."""
    seen: list[int] = []
    scan = packing._outside_vocabulary

    def counted(ids: np.ndarray, vocab_size: int | None) -> np.ndarray:
        seen.append(len(ids))
        return scan(ids, vocab_size)

    monkeypatch.setattr(packing, "_outside_vocabulary", counted)
    return seen


@pytest.mark.parametrize("reference", ["client", "policy"])
def test_compute_reference_logprobs_reads_the_ids_once(scans: list[int], reference: str) -> None:
    model = tiny_model()
    client = TorchSamplingClient(model) if reference == "client" else PolicyReference(model)
    scored, _ = compute_reference_logprobs(pairs(), client, ReferenceConfig(progress=False))
    assert scans == [sum(len(d.model_input.to_ints()) for d in pairs())]
    assert len(scored) == 4


def test_the_values_are_those_of_the_scorer_given_unchecked_ids() -> None:
    client = TorchSamplingClient(tiny_model())
    data = pairs()
    scored, _ = compute_reference_logprobs(data, client, ReferenceConfig(progress=False))
    direct = client.score_packed(PackedTokens.from_sequences([d.model_input.to_ints() for d in data])).numpy()
    got = np.concatenate([np.asarray(d.loss_fn_inputs["ref_logprobs"]) for d in scored])
    assert np.array_equal(got, direct)


def test_score_across_ranks_names_the_datum_and_the_position_of_a_bad_id() -> None:
    data = [Datum(ModelInput.from_ints([1, 2])), Datum(ModelInput.from_ints([3, 4, VOCAB]))]
    with pytest.raises(OutOfVocabularyError) as error:
        score_across_ranks(data, TorchSamplingClient(tiny_model()), [[1, 2], [3, 4, VOCAB]], progress=False)
    vocabulary = f"the reference's vocabulary [0, {VOCAB})"
    assert str(error.value) == f"datum 1 has token id {VOCAB} at position 2, outside {vocabulary}"
    assert (error.value.index, error.value.position, error.value.token, error.value.pair) == (1, 2, VOCAB, 0)


def test_a_scorer_still_checks_ids_given_to_it_directly() -> None:
    client = TorchSamplingClient(tiny_model())
    with pytest.raises(OutOfVocabularyError, match=f"prompt 1: token id {VOCAB} is outside"):
        client.score_packed(PackedTokens.from_sequences([[1, 2], [3, VOCAB]]))


def test_checked_tokens_stay_checked_when_sliced_and_only_for_their_vocabulary(scans: list[int]) -> None:
    checked = check_token_ids(PackedTokens.from_sequences([[1, 2], [3, 4, 5], [6]]), 8)
    part = checked.slice(1, 3)
    assert isinstance(part, CheckedTokens) and part.ids.tolist() == [3, 4, 5, 6] and part.offsets.tolist() == [0, 3, 4]
    assert check_token_ids(part, 8) is part and check_token_ids(part, None) is part
    assert len(scans) == 1
    with pytest.raises(OutOfVocabularyError, match="prompt 0: token id 5 is outside the model's vocabulary"):
        check_token_ids(part, 5)  # a smaller vocabulary: checked again
    assert len(scans) == 2
