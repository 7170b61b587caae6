"""A reference logprob is finite and <= 0, or a ValueError naming the datum and position: never attached, never
cached. Whatever answers (any client, on any call path; a local model; vLLM), and whatever was cached before."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch

from loops_callbacks.fields import model_input_tokens
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.across_ranks import ReferenceCacheWarning, score_across_ranks
from loops_callbacks.reference.cache import (CACHE_FILE_NAME, CacheKey, cache_file, checksum, data_fingerprint,
                                             read_cache, write_cache)
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.types import Datum, ModelInput

SEQUENCES = [[1, 2, 3], [4, 5, 6, 7], [2, 3]]


def data() -> list[Datum]:
    return [Datum(ModelInput.from_ints(tokens)) for tokens in SEQUENCES]


def answer(tokens: list[int], bad: float | None = None) -> list[float | None]:
    """[None, -1, -1, ...] with ``bad`` at element 2 of a 4-token prompt (ref_logprobs position 1 of datum 1)."""
    values: list[float | None] = [None] + [-1.0] * (len(tokens) - 1)
    if bad is not None and len(tokens) == 4:
        values[2] = bad
    return values


class Sync:
    def __init__(self, bad: float) -> None:
        self.bad = bad

    def compute_logprobs(self, prompt: Any) -> Any:
        return answer(model_input_tokens(prompt), self.bad)


class Batched(Sync):
    def compute_logprobs_batch(self, prompts: list[Any]) -> list[Any]:
        return [answer(model_input_tokens(p), self.bad) for p in prompts]


class Async(Sync):
    async def compute_logprobs_async(self, prompt: Any) -> Any:
        await asyncio.sleep(0)
        return answer(model_input_tokens(prompt), self.bad)


class Futures(Sync):
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    def compute_logprobs(self, prompt: Any) -> Any:
        return self.pool.submit(answer, model_input_tokens(prompt), self.bad)


class Tensors(Sync):
    def compute_logprobs(self, prompt: Any) -> Any:
        return torch.tensor([math.nan if v is None else v for v in answer(model_input_tokens(prompt), self.bad)])


def embedding_model(vocab: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab))


def with_a_nan_weight(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model[1].weight[5, 3] = math.nan  # the logit of token 5 is NaN, and with it every log-softmax
    return model


# ---- attach_reference_logprobs, any client ---------------------------------------------------------------


@pytest.mark.parametrize("client", [Sync, Batched, Async, Futures, Tensors])
@pytest.mark.parametrize("bad", [math.nan, 0.5, math.inf, -math.inf])
def test_a_value_that_is_no_logprob_is_never_attached_and_names_the_datum_and_position(client: type, bad: float) -> None:
    with pytest.raises(ValueError, match=rf"datum 1, position 1 is {bad:g}, not a logprob \(finite and <= 0\)"):
        attach_reference_logprobs(data(), client(bad))


def test_a_value_just_above_0_is_rounding_and_kept_as_it_is() -> None:
    [_, datum, _] = attach_reference_logprobs(data(), Sync(4e-4))  # a bf16 log_softmax of a near-certain token
    assert datum.loss_fn_inputs["ref_logprobs"].data == pytest.approx([-1.0, 4e-4, -1.0, 0.0])


def test_none_still_becomes_0_and_the_last_position_is_0() -> None:
    class Nones:
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            return [None] * prompt.length

    assert [d.loss_fn_inputs["ref_logprobs"].data for d in attach_reference_logprobs(data(), Nones())] == [
        [0.0] * len(tokens) for tokens in SEQUENCES]


@pytest.mark.parametrize("given", ["abc", None, 3.5, {"logprobs": [None, -1.0, -1.0, -1.0]}, b"abcd"])
def test_an_answer_that_is_not_a_list_names_the_datum_and_what_it_is(given: Any) -> None:
    class Odd:
        def compute_logprobs(self, prompt: Any) -> Any:
            return given if prompt.length == 4 else answer(prompt.to_ints())

    with pytest.raises(TypeError, match=rf"datum 1: the reference returned a {type(given).__name__}, not a list of "
                                        r"logprobs \(one per token, element 0 None\)"):
        attach_reference_logprobs(data(), Odd())


@pytest.mark.parametrize("element", ["x", [-1.0], object()])
def test_an_element_that_is_not_a_number_names_the_datum_and_the_element(element: Any) -> None:
    class Odd:
        def compute_logprobs(self, prompt: Any) -> Any:
            values: list[Any] = answer(prompt.to_ints())
            if prompt.length == 4:
                values[3] = element
            return values

    with pytest.raises(TypeError, match=r"datum 1: element 3 of the reference's answer is .*, not a number or None"):
        attach_reference_logprobs(data(), Odd())


def test_a_batch_answer_that_is_not_a_list_names_the_datums() -> None:
    class NoAnswer(Batched):
        def compute_logprobs_batch(self, prompts: list[Any]) -> Any:
            return None

    with pytest.raises(TypeError, match=r"compute_logprobs_batch returned a NoneType for datums 0\.\.2, not a list"):
        attach_reference_logprobs(data(), NoAnswer(0.0))


@pytest.mark.parametrize("model_input", [torch.tensor([[1, 2, 3]]), np.array([[1, 2], [3, 4]]), torch.tensor(5)])
def test_a_model_input_that_is_not_1d_names_the_datum_and_its_shape(model_input: Any) -> None:
    datums = [{"model_input": [1, 2, 3], "loss_fn_inputs": {}}, {"model_input": model_input, "loss_fn_inputs": {}}]
    shape = tuple(model_input.shape)
    with pytest.raises(ValueError, match=rf"datum 1: model_input: expected a 1-D sequence of token ids, got a "
                                         rf"{type(model_input).__name__} of shape {re_escape(shape)}"):
        attach_reference_logprobs(datums, Sync(0.0))
    with pytest.raises(ValueError, match=r"prompt 0: expected a 1-D sequence of token ids"):
        TorchSamplingClient(embedding_model()).compute_logprobs(model_input)


def test_token_ids_that_are_not_ints_name_the_datum() -> None:
    datums = [{"model_input": [[1, 2], [3]], "loss_fn_inputs": {}}]
    with pytest.raises(TypeError, match=r"datum 0: model_input: expected token ids \(ints\), got \[1, 2\] \(a list\)"):
        attach_reference_logprobs(datums, Sync(0.0))


@pytest.mark.parametrize("model_input", [[1.7, 5.2], [True, 0], torch.tensor([1.9, 2.5]), np.array([1.5, 2.0])])
def test_token_ids_are_never_rounded_from_floats_or_read_from_bools(model_input: object) -> None:
    """[1.7, 5.2] was scored as [1, 5]: a model_input of floats or bools holds no token ids."""
    with pytest.raises(TypeError, match=r"datum 0: model_input: expected token ids \(ints\), got .* at position 0"):
        attach_reference_logprobs([{"model_input": model_input, "loss_fn_inputs": {}}], Sync(0.0))


def re_escape(shape: tuple[int, ...]) -> str:
    return str(shape).replace("(", r"\(").replace(")", r"\)")


# ---- a local model ---------------------------------------------------------------------------------------


def test_a_reference_model_with_a_nan_weight_is_refused_by_every_form_of_the_client() -> None:
    client = TorchSamplingClient(with_a_nan_weight(embedding_model()))
    with pytest.raises(ValueError, match=r"TorchSamplingClient's reference logprobs: datum 0, position 0 is nan, not "
                                         r"a logprob .*; 6 such values in all.*a NaN or infinite weight"):
        client.score_packed(PackedTokens.from_sequences(SEQUENCES))
    with pytest.raises(ValueError, match=r"datum 0, position 0 is nan"):
        client.compute_logprobs([1, 2, 3])
    with pytest.raises(ValueError, match=r"datum 0, position 0 is nan"):
        attach_reference_logprobs(data(), client)


def test_a_reference_model_with_a_nan_weight_writes_no_cache_and_the_next_run_scores_again(tmp_path: Path) -> None:
    config = ReferenceConfig(cache_dir=str(tmp_path), progress=False)
    broken = TorchSamplingClient(with_a_nan_weight(embedding_model()))
    with pytest.raises(ValueError, match=r"datum 0, position 0 is nan, not a logprob"):
        score_across_ranks(SEQUENCES, broken, config)
    assert os.listdir(tmp_path) == []  # nothing written, so nothing "loaded from the cache" later
    values, report = score_across_ranks(SEQUENCES, TorchSamplingClient(embedding_model()), config)
    assert report.source == "scored" and report.cache_written and np.isfinite(values).all() and (values <= 0).all()


# ---- the cache ---------------------------------------------------------------------------------------------


def key() -> CacheKey:
    return CacheKey(reference="r", data=data_fingerprint(SEQUENCES), dtype="float32")


@pytest.mark.parametrize("bad", [math.nan, 0.25, -math.inf])
def test_write_cache_refuses_values_that_are_not_logprobs_and_writes_nothing(tmp_path: Path, bad: float) -> None:
    path = cache_file(tmp_path / CACHE_FILE_NAME, key())
    values = [np.array([-1.0, -2.0, 0.0]), np.array([-1.0, bad, -3.0, 0.0]), np.array([-1.0, 0.0])]
    with pytest.raises(ValueError, match=rf"write_cache: the values to cache: datum 1, position 1 is {bad:g}, not a "
                                         r"logprob"):
        write_cache(path, key(), values)
    with pytest.raises(ValueError, match=rf"datum 1, position 1 is {bad:g}"):
        write_cache(path, key(), np.concatenate(values), [3, 4, 2])
    assert os.listdir(tmp_path) == []


def unchecked_cache(path: str, flat: np.ndarray, lengths: list[int]) -> None:
    """A cache file as an earlier version wrote it: the same format, its values not checked."""
    flat, sizes = flat.astype("<f4"), np.asarray(lengths, dtype="<i8")
    metadata = {"format": "loops-callbacks reference logprobs 3", "reference": key().reference, "data": key().data,
                "dtype": key().dtype, "sha256": checksum(sizes, flat)}
    Path(path).write_bytes(safetensors.numpy.save({"values": flat, "lengths": sizes}, metadata=metadata))


def test_a_cache_file_holding_values_that_are_not_logprobs_is_damaged_and_scored_again(tmp_path: Path) -> None:
    client = TorchSamplingClient(embedding_model())
    config = ReferenceConfig(cache_dir=str(tmp_path), progress=False, reference_fingerprint="r")
    path = cache_file(tmp_path / CACHE_FILE_NAME, key())
    unchecked_cache(path, np.array([-1, -2, 0, -1, math.nan, -3, 0, -1, 0]), [3, 4, 2])
    lookup = read_cache(path, key(), [3, 4, 2])
    assert lookup.status == "corrupt" and lookup.flat is None
    assert "datum 1, position 1 is nan, not a logprob" in lookup.reason
    with pytest.warns(ReferenceCacheWarning, match=r"is not used and will be replaced: .*datum 1, position 1 is nan"):
        values, report = score_across_ranks(SEQUENCES, client, config, cache_tag="float32")
    assert (report.source, report.cache_status, report.cache_written) == ("scored", "corrupt", True)
    assert np.isfinite(values).all() and read_cache(path, key(), [3, 4, 2]).status == "hit"


def test_a_hugging_face_reference_with_a_nan_head_weight_is_refused_on_the_output_head_path() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config).eval()
    client = TorchSamplingClient(model)  # used in place: the weights it scores are the model's of the moment
    client.score_packed(PackedTokens.from_sequences(SEQUENCES))  # the head path checked once, on finite weights
    with torch.no_grad():
        model.lm_head.weight[7, 0] = math.nan
    with pytest.raises(ValueError, match=r"datum 0, position 0 is nan, not a logprob"):
        client.score_packed(PackedTokens.from_sequences(SEQUENCES))
    assert client.path == "output_head"
