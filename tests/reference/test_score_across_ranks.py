"""``score_packed_across_ranks``: token ids in, one float32 buffer of reference values out, no datum;
``score_across_ranks`` is it plus the datum boundary (the same values, as views of that buffer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loops_callbacks.reference import ScoringOptions, score_across_ranks, score_packed_across_ranks
from loops_callbacks.reference.cache import CACHE_FILE_NAME
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.types import Datum, ModelInput

SEQUENCES = [[1, 2, 3], [1, 4], [5, 6, 7, 8], [5, 9]]
QUIET = ScoringOptions(progress=False)


def client() -> TorchSamplingClient:
    torch.manual_seed(0)
    return TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)))


class Remote:
    """A client with no score_packed (it scores each datum's model_input, as a remote sampler does)."""

    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        return [None] + [-0.25 * k for k in range(1, prompt.length)]


def test_the_values_are_one_float32_buffer_in_the_packed_layout() -> None:
    packed = PackedTokens.from_sequences(SEQUENCES)
    values, report = score_packed_across_ranks(packed, client(), ScoringOptions(progress=False, shard_unit=2))
    assert isinstance(values, np.ndarray) and values.dtype == np.float32 and values.shape == (packed.num_tokens,)
    assert values[packed.offsets[1:] - 1].tolist() == [0.0] * len(SEQUENCES)  # nothing predicted at a last token
    assert report.num_datums == len(SEQUENCES) and report.source == "scored"

    datums = [Datum(ModelInput.from_ints(s)) for s in SEQUENCES]
    scored, _ = score_across_ranks(datums, client(), SEQUENCES, progress=False, shard_unit=2)
    assert np.array_equal(np.concatenate([d.loss_fn_inputs["ref_logprobs"] for d in scored]), values)


def test_a_cache_hit_gives_the_same_buffer(tmp_path: Path) -> None:
    packed = PackedTokens.from_sequences(SEQUENCES)
    path = tmp_path / CACHE_FILE_NAME
    first, report = score_packed_across_ranks(packed, client(), ScoringOptions(cache_path=path, progress=False))
    second, again = score_packed_across_ranks(packed, client(), ScoringOptions(cache_path=path, progress=False))
    assert (report.source, report.cache_written, again.source) == ("scored", True, "cache")
    assert second.dtype == np.float32 and np.array_equal(first, second)


def test_a_client_without_score_packed_scores_the_datums_it_is_given() -> None:
    packed = PackedTokens.from_sequences(SEQUENCES)
    datums = [Datum(ModelInput.from_ints(s)) for s in SEQUENCES]
    values, _ = score_packed_across_ranks(packed, Remote(), QUIET, datums=datums)
    assert values[:3].tolist() == [-0.25, -0.5, 0.0]
    with pytest.raises(TypeError, match=r"the reference \(Remote\) has no score_packed: .* give the datums"):
        score_packed_across_ranks(packed, Remote(), QUIET)
    with pytest.raises(ValueError, match="4 token sequences for 3 datums"):
        score_packed_across_ranks(packed, Remote(), QUIET, datums=datums[:3])
