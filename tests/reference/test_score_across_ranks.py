"""``score_across_ranks``: token ids in, one float32 buffer of reference values out, no datum; the ids are
checked once on their way (the scorers get a checked form they do not read again, and still check ids given to
them directly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loops_callbacks.data import ReferenceLogprobsMixin, dpo_pair_datums
from loops_callbacks.data.dpo import OutOfVocabularyError
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference import ReferenceConfig, score_across_ranks
from loops_callbacks.reference import packing
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.packing import CheckedTokens, PackedTokens, check_token_ids
from loops_callbacks.reference.policy import PolicyReference
from loops_callbacks.types import Datum, ModelInput

SEQUENCES = [[1, 2, 3], [1, 4], [5, 6, 7, 8], [5, 9]]
QUIET = ReferenceConfig(progress=False)
VOCAB = 16


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def client() -> TorchSamplingClient:
    return TorchSamplingClient(tiny_model())


class Remote:
    """A client with no score_packed (it scores each prompt's model_input, as a remote sampler does)."""

    def __init__(self) -> None:
        self.prompts: list[Any] = []

    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        self.prompts.append(prompt)
        return [None] + [-0.25 * k for k in range(1, prompt.length)]


def test_the_values_are_one_float32_buffer_in_the_packed_layout() -> None:
    packed = PackedTokens.from_sequences(SEQUENCES)
    values, report = score_across_ranks(packed, client(), QUIET, shard_unit=2)
    assert isinstance(values, np.ndarray) and values.dtype == np.float32 and values.shape == (packed.num_tokens,)
    assert values[packed.offsets[1:] - 1].tolist() == [0.0] * len(SEQUENCES)  # nothing predicted at a last token
    assert report.n_datums == len(SEQUENCES) and report.source == "scored"
    datums = [Datum(ModelInput.from_ints(s)) for s in SEQUENCES]
    attached = attach_reference_logprobs(datums, client())
    assert np.allclose(np.concatenate([d.loss_fn_inputs["ref_logprobs"].data for d in attached]), values, atol=1e-6)


def test_a_cache_hit_gives_the_same_buffer(tmp_path: Path) -> None:
    config = ReferenceConfig(cache_dir=str(tmp_path), progress=False)
    first, report = score_across_ranks(SEQUENCES, client(), config)
    second, again = score_across_ranks(SEQUENCES, client(), config)
    assert (report.source, report.cache_written, again.source) == ("scored", True, "cache")
    assert second.dtype == np.float32 and np.array_equal(first, second)


def test_a_client_without_score_packed_scores_the_datums_it_is_given() -> None:
    datums = [Datum(ModelInput.from_ints(s)) for s in SEQUENCES]
    remote = Remote()
    values, _ = score_across_ranks(SEQUENCES, remote, QUIET, datums=datums)
    assert values[:3].tolist() == [-0.25, -0.5, 0.0]
    assert [id(p) for p in remote.prompts] == [id(d.model_input) for d in datums]  # their own model_input
    alone, _ = score_across_ranks(SEQUENCES, Remote(), QUIET)  # without datums: prompts of the token ids
    assert np.array_equal(alone, values)
    with pytest.raises(ValueError, match="4 token sequences for 3 datums"):
        score_across_ranks(SEQUENCES, Remote(), QUIET, datums=datums[:3])
    with pytest.raises(ValueError, match="shard_unit must be an int >= 1, got 0"):
        score_across_ranks(SEQUENCES, Remote(), QUIET, shard_unit=0)
    with pytest.raises(ValueError, match="4 datums are not a whole number of units of 3"):
        score_across_ranks(SEQUENCES, Remote(), QUIET, shard_unit=3)


# ----------------------------------------------------------------------------- the ids, checked once


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


def pairs() -> list[Any]:
    return [*dpo_pair_datums([1, 2, 3], [1, 4], prompt_length=1), *dpo_pair_datums([5, 6, 7], [5, 9], prompt_length=1)]


class _Base:
    """What ``LightningDataModule.setup`` is to the mixin (nothing)."""

    def setup(self, stage: str) -> None:
        pass


class Pairs(ReferenceLogprobsMixin, _Base):
    def __init__(self, reference: Any) -> None:
        super().__init__()
        self.configure_reference(reference, use_cache=False, progress=False)

    def dpo_data(self) -> list[Any]:
        return pairs()


@pytest.mark.parametrize("reference", ["client", "policy"])
def test_the_datamodule_reads_the_ids_once(scans: list[int], reference: str) -> None:
    model = tiny_model()
    module = Pairs(TorchSamplingClient(model) if reference == "client" else PolicyReference(model))
    module.setup("fit")
    assert scans == [sum(len(d.model_input.to_ints()) for d in pairs())]
    assert len(module.scored_pairs) == 4
    direct = TorchSamplingClient(model).score_packed(module.scored_pairs.tokens).numpy()
    assert np.array_equal(module.scored_pairs.ref_logprobs, direct)  # as the scorer gives unchecked ids


def test_a_bad_id_is_named_with_the_datum_and_its_position() -> None:
    with pytest.raises(OutOfVocabularyError) as error:
        score_across_ranks([[1, 2], [3, 4, VOCAB]], client(), QUIET)
    vocabulary = f"the reference's vocabulary [0, {VOCAB})"
    assert str(error.value) == f"datum 1 has token id {VOCAB} at position 2, outside {vocabulary}"
    assert (error.value.index, error.value.position, error.value.token, error.value.pair) == (1, 2, VOCAB, 0)


def test_a_scorer_still_checks_ids_given_to_it_directly() -> None:
    with pytest.raises(OutOfVocabularyError, match=f"prompt 1 has token id {VOCAB} at position 1, outside"):
        client().score_packed(PackedTokens.from_sequences([[1, 2], [3, VOCAB]]))


def test_checked_tokens_stay_checked_when_sliced_and_only_for_their_vocabulary(scans: list[int]) -> None:
    checked = check_token_ids(PackedTokens.from_sequences([[1, 2], [3, 4, 5], [6]]), 8)
    part = checked.slice(1, 3)
    assert isinstance(part, CheckedTokens) and part.ids.tolist() == [3, 4, 5, 6] and part.offsets.tolist() == [0, 3, 4]
    assert check_token_ids(part, 8) is part and check_token_ids(part, None) is part
    assert len(scans) == 1
    with pytest.raises(OutOfVocabularyError, match="prompt 0 has token id 5 at position 2, outside the reference's"):
        check_token_ids(part, 5)  # a smaller vocabulary: checked again
    assert len(scans) == 2


class OwnScorer:
    """A reference of its own with score_packed (the fast path), whose values are not logprobs at one position."""

    def score_packed(self, packed: PackedTokens, **_: Any) -> torch.Tensor:
        values = torch.full((packed.num_tokens,), -0.5)
        values[int(packed.offsets[1]) + 1] = float("nan")  # datum 1, position 1
        return values


def test_a_reference_of_its_own_whose_values_are_not_logprobs_is_named_with_the_cache_off() -> None:
    """With the cache on, write_cache refuses them; with it off, nothing looked before the values were used."""
    with pytest.raises(ValueError, match=r"datum 1, position 1 is nan, not a logprob"):
        score_across_ranks(PackedTokens.from_sequences(SEQUENCES), OwnScorer(), QUIET, shard_unit=2)
