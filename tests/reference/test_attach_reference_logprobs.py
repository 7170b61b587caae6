"""``attach_reference_logprobs``: the Loops SDK's numbers, on every datum kind and every call path."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from typing_extensions import deprecated

from loops_callbacks.fields import model_input_tokens
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient
from loops_callbacks.types import Datum, ModelInput, TensorData


def fake_logprobs(tokens: list[int]) -> list[float | None]:
    """A deterministic 'model': element 0 is None, token 0 is unscored (None), others depend on context."""
    out: list[float | None] = [None]
    for i in range(1, len(tokens)):
        out.append(None if tokens[i] == 0 else -0.125 * ((3 * tokens[i] + tokens[i - 1] + i) % 11) - 0.0625)
    return out


def sdk_reference(tokens: list[int]) -> list[float]:
    """The SDK's rule, written out once more for the expectations."""
    lp = fake_logprobs(tokens)
    return [0.0 if v is None else float(v) for v in lp[1:]] + [0.0]


class SyncClient:
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        tokens = model_input_tokens(prompt)
        self.calls.append(tokens)
        return fake_logprobs(tokens)


class BatchClient:
    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        raise AssertionError("the batch method should be used")

    def compute_logprobs_batch(self, prompts: list[Any]) -> list[list[float | None]]:
        self.batch_sizes.append(len(prompts))
        return [fake_logprobs(model_input_tokens(p)) for p in prompts]


class AsyncClient:
    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.in_flight = 0
        self.max_in_flight = 0

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        raise AssertionError("the async method should be used")

    async def compute_logprobs_async(self, prompt: Any) -> list[float | None]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return fake_logprobs(model_input_tokens(prompt))


class FutureClient:
    """Tinker-like: ``compute_logprobs`` returns a future; ``compute_logprobs_async`` is deprecated."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def _work(self, tokens: list[int]) -> list[float | None]:
        time.sleep(0.002)
        with self.lock:
            self.in_flight -= 1
        return fake_logprobs(tokens)

    def compute_logprobs(self, prompt: Any) -> concurrent.futures.Future:
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return self.pool.submit(self._work, model_input_tokens(prompt))

    @deprecated("use compute_logprobs", category=FutureWarning)
    async def compute_logprobs_async(self, prompt: Any) -> list[float | None]:
        raise AssertionError("a deprecated method should not be used")


def make_data(n: int = 7, seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for i in range(n):
        length = int(rng.integers(1, 12))
        tokens = rng.integers(0, 9, size=length).tolist()
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens),
                loss_fn_inputs={
                    "target_tokens": TensorData(tokens[1:] + [0], "int64", [length]),
                    "mask": TensorData([1.0] * length, "float32", [length]),
                },
            )
        )
    return data


def plain(datum: Any) -> Any:
    """A datum as plain Python values, for deep comparisons across datum kinds."""
    if isinstance(datum, dict):
        mi, inputs = datum["model_input"], datum["loss_fn_inputs"]
        extra = {k: v for k, v in datum.items() if k not in ("model_input", "loss_fn_inputs")}
    else:
        mi, inputs, extra = datum.model_input, datum.loss_fn_inputs, {}
    fields = {
        k: (list(v.data), str(v.dtype), list(v.shape)) if hasattr(v, "dtype") and hasattr(v, "data") else v
        for k, v in inputs.items()
    }
    return model_input_tokens(mi), fields, extra


def ref_of(datum: Any) -> list[float]:
    inputs = datum["loss_fn_inputs"] if isinstance(datum, dict) else datum.loss_fn_inputs
    return list(inputs["ref_logprobs"].data)


# --- semantics ---------------------------------------------------------------------------------


def test_shift_none_and_trailing_zero_by_hand() -> None:
    class Table:
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            return {(5, 6, 7): [None, -0.5, None], (4,): [None], (1, 2): [None, -2.25]}[tuple(prompt.to_ints())]

    data = [Datum(ModelInput.from_ints(t)) for t in ([5, 6, 7], [4], [1, 2])]
    out = attach_reference_logprobs(data, Table())
    assert [ref_of(d) for d in out] == [[-0.5, 0.0, 0.0], [0.0], [-2.25, 0.0]]
    for d in out:
        td = d.loss_fn_inputs["ref_logprobs"]
        assert isinstance(td, TensorData) and td.dtype == "float32" and td.shape == [d.model_input.length]


def test_matches_sdk_rule_and_keeps_model_input_and_other_fields() -> None:
    data = make_data()
    out = attach_reference_logprobs(data, SyncClient())
    assert len(out) == len(data)
    for old, new in zip(data, out):
        assert ref_of(new) == sdk_reference(old.model_input.to_ints())
        assert new.model_input is old.model_input
        for key, value in old.loss_fn_inputs.items():
            assert new.loss_fn_inputs[key] is value
        assert list(new.loss_fn_inputs) == [*old.loss_fn_inputs, "ref_logprobs"]


def test_existing_ref_logprobs_is_replaced_and_inputs_are_not_modified() -> None:
    data = make_data()
    data[2].loss_fn_inputs["ref_logprobs"] = TensorData([9.0] * data[2].model_input.length, "float32")
    before = copy.deepcopy(data)
    before_plain = [plain(d) for d in data]
    dicts = [d.loss_fn_inputs for d in data]
    out = attach_reference_logprobs(data, SyncClient())
    assert data == before and [plain(d) for d in data] == before_plain
    assert all(d.loss_fn_inputs is dct for d, dct in zip(data, dicts))
    assert all(new is not old and new.loss_fn_inputs is not old.loss_fn_inputs for new, old in zip(out, data))
    assert ref_of(out[2]) == sdk_reference(data[2].model_input.to_ints())


def test_calls_the_reference_once_per_datum_in_order() -> None:
    data = make_data()
    client = SyncClient()
    attach_reference_logprobs(data, client)
    assert client.calls == [d.model_input.to_ints() for d in data]


@dataclasses.dataclass
class TaggedDatum(Datum):
    source: str = ""


def test_extra_dataclass_fields_and_attributes_are_kept() -> None:
    datum = TaggedDatum(ModelInput.from_ints([1, 2, 3]), {"mask": [1.0, 1.0, 1.0]}, source="gsm8k")
    datum.group_id = 17  # an attribute outside the fields
    [new] = attach_reference_logprobs([datum], SyncClient())
    assert type(new) is TaggedDatum and new.source == "gsm8k" and new.group_id == 17
    assert ref_of(new) == sdk_reference([1, 2, 3])
    assert datum.loss_fn_inputs == {"mask": [1.0, 1.0, 1.0]}


def test_mapping_datums() -> None:
    data = [
        {"model_input": ModelInput.from_ints(t), "loss_fn_inputs": {"mask": [1.0] * len(t)}, "id": i}
        for i, t in enumerate([[3, 1, 4, 1], [5, 9]])
    ]
    before = copy.deepcopy(data)
    out = attach_reference_logprobs(data, SyncClient())
    assert data == before
    assert [d["id"] for d in out] == [0, 1]
    assert [ref_of(d) for d in out] == [sdk_reference([3, 1, 4, 1]), sdk_reference([5, 9])]
    assert isinstance(out[0]["loss_fn_inputs"]["ref_logprobs"], TensorData)


def test_pydantic_datums() -> None:
    pydantic = pytest.importorskip("pydantic", reason="pydantic datums need pydantic")

    class PydanticDatum(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        model_input: Any
        loss_fn_inputs: dict[str, Any] = {}
        note: str = ""

    datum = PydanticDatum(model_input=ModelInput.from_ints([2, 7, 1]), loss_fn_inputs={"mask": [1, 1, 1]}, note="x")
    [new] = attach_reference_logprobs([datum], SyncClient())
    assert isinstance(new, PydanticDatum) and new.note == "x"
    assert ref_of(new) == sdk_reference([2, 7, 1])
    assert "ref_logprobs" not in datum.loss_fn_inputs


def test_tinker_datums_get_tinker_tensor_data_and_keep_provenance() -> None:
    tinker = pytest.importorskip("tinker", reason="tinker's own types")
    from tinker.types import PromptProvenanceSpan, SampledProvenanceSpan

    tokens = [4, 0, 8, 2, 6]
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": tokens[1:] + [0], "weights": [0.0, 1.0, 1.0, 1.0, 1.0]},
    ).with_provenance(
        model_input=[PromptProvenanceSpan(sequence_id="p", length=2), SampledProvenanceSpan(sequence_id="s", length=3)],
        loss_fn_inputs=[PromptProvenanceSpan(sequence_id="p", length=5)],
    )
    before = plain(datum)
    [new] = attach_reference_logprobs([datum], SyncClient())
    assert type(new) is tinker.Datum
    ref = new.loss_fn_inputs["ref_logprobs"]
    assert isinstance(ref, tinker.TensorData) and ref.dtype == "float32" and list(ref.shape) == [5]
    np.testing.assert_allclose(ref.data, sdk_reference(tokens), rtol=0, atol=1e-7)  # stored as float32
    assert new.model_input_spans == datum.model_input_spans and new.loss_fn_input_spans == datum.loss_fn_input_spans
    assert new.loss_fn_inputs["target_tokens"] is datum.loss_fn_inputs["target_tokens"]
    assert plain(datum) == before and "ref_logprobs" not in datum.loss_fn_inputs


def test_reference_answers_as_arrays_and_tensors() -> None:
    def values(tokens: list[int]) -> list[float]:
        return [-1.0 if v is None else v for v in fake_logprobs(tokens)]

    class ArrayClient:
        def compute_logprobs(self, prompt: Any) -> Any:
            array = np.array(values(prompt.to_ints()))
            return array if prompt.length % 2 else torch.from_numpy(array)

    data = make_data()
    for old, new in zip(data, attach_reference_logprobs(data, ArrayClient())):
        assert ref_of(new) == values(old.model_input.to_ints())[1:] + [0.0]


# --- call paths ----------------------------------------------------------------------------------


def test_batched_async_futures_and_sequential_paths_agree() -> None:
    data = make_data(40, seed=3)
    expected = [plain(d) for d in attach_reference_logprobs(data, SyncClient())]
    batch = BatchClient()
    assert [plain(d) for d in attach_reference_logprobs(data, batch, batch_size=16)] == expected
    assert batch.batch_sizes == [16, 16, 8]
    async_client = AsyncClient(delay=0.001)
    assert [plain(d) for d in attach_reference_logprobs(data, async_client, max_concurrency=5)] == expected
    assert async_client.max_in_flight == 5
    future_client = FutureClient()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecated async method is not called
        assert [plain(d) for d in attach_reference_logprobs(data, future_client, max_concurrency=4)] == expected
    assert 1 < future_client.max_in_flight <= 4


def test_batched_path_defaults_to_one_call() -> None:
    client = BatchClient()
    attach_reference_logprobs(make_data(9), client)
    assert client.batch_sizes == [9]


def test_async_path_from_inside_a_running_event_loop() -> None:
    data = make_data(6)
    expected = [plain(d) for d in attach_reference_logprobs(data, SyncClient())]

    async def main() -> list[Any]:
        return attach_reference_logprobs(data, AsyncClient(delay=0.001))

    assert [plain(d) for d in asyncio.run(main())] == expected


def test_concurrency_keeps_max_concurrency_requests_in_flight() -> None:
    data = make_data(64)
    client = AsyncClient(delay=0.02)
    attach_reference_logprobs(data, client, max_concurrency=32)
    assert client.max_in_flight == 32  # a slow client is waited on 32 at a time, not one by one


def test_torch_client_batched_equals_one_by_one() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(9, 16), torch.nn.Linear(16, 9))
    client = TorchSamplingClient(model, max_tokens_per_batch=32)

    class OneByOne:
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            return client.compute_logprobs(prompt)

    data = make_data(20, seed=5)
    batched = attach_reference_logprobs(data, client)
    single = attach_reference_logprobs(data, OneByOne())
    for a, b in zip(batched, single):
        np.testing.assert_allclose(ref_of(a), ref_of(b), rtol=0, atol=1e-5)
        assert ref_of(a)[-1] == 0.0


# --- progress ------------------------------------------------------------------------------------


def test_progress_callable_and_bar(capsys: pytest.CaptureFixture[str]) -> None:
    data = make_data(10)
    seen: list[tuple[int, int]] = []
    attach_reference_logprobs(data, BatchClient(), batch_size=4, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(4, 10), (8, 10), (10, 10)]
    seen.clear()
    attach_reference_logprobs(data, AsyncClient(), progress=lambda done, total: seen.append((done, total)))
    assert [done for done, _ in seen] == list(range(1, 11))
    attach_reference_logprobs(data, SyncClient(), progress=True)
    assert "10/10" in capsys.readouterr().err


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-3, ValueError), (True, TypeError), (2.5, TypeError)])
def test_bad_max_concurrency(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"max_concurrency must be an int >= 1, got {value!r}"):
        attach_reference_logprobs(make_data(2), SyncClient(), max_concurrency=value)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), ("4", TypeError)])
def test_bad_batch_size(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"batch_size must be an int >= 1 or None, got {value!r}"):
        attach_reference_logprobs(make_data(2), BatchClient(), batch_size=value)


def test_datum_without_model_input_names_its_index() -> None:
    data: list[Any] = [*make_data(2), {"loss_fn_inputs": {}}]
    with pytest.raises(ValueError, match="datum 2"):
        attach_reference_logprobs(data, SyncClient())


def test_empty_model_input_names_its_index() -> None:
    data = [*make_data(1), Datum(ModelInput.from_ints([]))]
    with pytest.raises(ValueError, match="datum 1.*empty"):
        attach_reference_logprobs(data, SyncClient())


def test_datum_without_loss_fn_inputs_fails_before_scoring() -> None:
    client = SyncClient()
    with pytest.raises(TypeError, match="datum 1"):
        attach_reference_logprobs([make_data(1)[0], {"model_input": [1, 2]}], client)
    assert client.calls == []


def test_one_datum_instead_of_a_list_is_a_type_error_that_says_so() -> None:
    for given in (make_data(1)[0], {"model_input": [1, 2], "loss_fn_inputs": {}}, "datums"):
        with pytest.raises(TypeError, match=r"data must be a sequence of datums, got \w+ \(one datum: pass \[datum\]\)"):
            attach_reference_logprobs(given, SyncClient())  # type: ignore[arg-type]


def test_a_per_position_field_of_another_length_names_the_datum_the_key_and_both_lengths() -> None:
    client, good = SyncClient(), make_data(1)[0]
    short = Datum(ModelInput.from_ints([1, 5, 6]), {"weights": [0.0, 1.0]})
    with pytest.raises(ValueError, match=r"datum 1: loss_fn_inputs\['weights'\] has 2 positions but model_input has 3"):
        attach_reference_logprobs([good, short], client)
    assert client.calls == []  # refused before any scoring: nothing is truncated or padded
    # what was accepted before stays accepted: one value for the datum, none, another dimension, a map-style dataset
    for weights in (None, 1.0, [1.0], np.ones((3, 2))):
        attach_reference_logprobs([Datum(ModelInput.from_ints([1, 5, 6]), {"weights": weights})], client)

    class MapStyle(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> Datum:
            if index >= 2:
                raise IndexError(index)
            return good

    assert len(attach_reference_logprobs(MapStyle(), client)) == 2


def test_wrong_length_answer_is_an_error_not_a_truncation() -> None:
    class OffByOne:
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            return fake_logprobs(prompt.to_ints())[1:] if prompt.length == 4 else fake_logprobs(prompt.to_ints())

    data = [Datum(ModelInput.from_ints([1, 2])), Datum(ModelInput.from_ints([1, 2, 3, 4]))]
    with pytest.raises(ValueError, match=r"datum 1: the reference returned 3 logprobs .* length 4"):
        attach_reference_logprobs(data, OffByOne())


def test_batch_answer_of_wrong_count() -> None:
    class Short(BatchClient):
        def compute_logprobs_batch(self, prompts: list[Any]) -> list[list[float | None]]:
            return super().compute_logprobs_batch(prompts)[:-1]

    with pytest.raises(ValueError, match="returned 2 results for 3 prompts"):
        attach_reference_logprobs(make_data(3), Short())


def test_reference_without_any_scoring_method() -> None:
    with pytest.raises(TypeError, match="compute_logprobs.*object"):
        attach_reference_logprobs(make_data(1), object())


def test_fakes_are_sampling_clients() -> None:
    assert isinstance(SyncClient(), SamplingClient) and isinstance(FutureClient(), SamplingClient)
    assert not isinstance(object(), SamplingClient)
