"""What ``read_step`` says about per-datum keys and advantages it cannot use as given.

Monitoring never stops training over ``policy_version`` or ``group``: a value the strata cannot
use is one warning that names the key, what was given (its type or shape, the datum) and the
batch size expected, and says what the monitor does instead. Advantages holding NaN are not read
here: the batch marks them (``FlatBatch.advantage_nan``), the statistics count them, and the
monitor says how many of how many masked-in positions from the step's totals
(``report.nan_advantages_message``). The caller's data is never modified.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from loops_callbacks.divergence.batch import FlatBatch
from loops_callbacks.divergence.report import nan_advantages_message
from loops_callbacks.divergence.statistics import DivergenceStats
from loops_callbacks.divergence.batch import ReadOptions, data_keys, key_label, read_step
from loops_callbacks.run_warnings import RunWarnings

B, T, STEP = 3, 4, 5
OFF = {"policy_version": "the per-lag numbers are not computed", "group": "the per-group numbers are not computed"}


def padded(**extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A padded step of ``B`` rows of ``T`` masked-in positions: (output, batch)."""
    batch = {"logprobs": torch.full((B, T), -1.0), "mask": torch.ones(B, T), **extra}
    return {"training_logprobs": torch.full((B, T), -1.25)}, batch


def datums(**fields: list[Any]) -> tuple[dict[str, Any], None]:
    """A datum step of ``B`` datums of ``T`` positions, ``fields[key][i]`` in datum i's loss_fn_inputs."""
    data = []
    for i in range(B):
        inputs: dict[str, Any] = {"logprobs": [-1.0] * T, "mask": [1.0] * T}
        inputs.update({key: values[i] for key, values in fields.items()})
        data.append({"model_input": list(range(T)), "loss_fn_inputs": inputs})
    return {"training_logprobs": [torch.full((T,), -1.25)] * B, "data": data}, None


def read(step: tuple[Any, Any], keys: dict[str, str] | None = None, **options: Any) -> tuple[FlatBatch, list[str]]:
    """``read_step`` with strata on: the batch and every warning it gave (it never raises)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = read_step(*step, ReadOptions(keys or {}, **options), optimizer_step=STEP, warnings=RunWarnings())
    return flat, [str(w.message) for w in caught]


def one_warning(step: tuple[Any, Any], keys: dict[str, str] | None = None, **options: Any) -> tuple[FlatBatch, str]:
    flat, said = read(step, keys, **options)
    assert len(said) == 1, said
    return flat, said[0]


NAMES = ("policy_version", "group")
RENAMED = {"policy_version": "sampler_step", "group": "task_id"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("renamed", [False, True])
@pytest.mark.parametrize(
    ("given", "described"),
    [
        (None, r"is None in the batch"),
        ([], r"is empty \(a list of length 0\)"),
        (torch.tensor([], dtype=torch.int64), r"is empty \(a tensor of shape \(0,\) and dtype torch.int64\)"),
        (torch.ones(B, 1, dtype=torch.int64), r"is a tensor of shape \(3, 1\) and dtype torch.int64"),
        ([[1]] * B, r"is a list of shape \(3, 1\)"),
        (np.ones((B, 2), dtype=np.int64), r"is a numpy array of shape \(3, 2\) and dtype int64"),
    ],
    ids=["None", "empty list", "empty tensor", "[B, 1] tensor", "nested list", "[B, 2] array"],
)
def test_a_padded_key_that_is_none_empty_or_2d_is_said_as_given(
    name: str, renamed: bool, given: Any, described: str
) -> None:
    key = RENAMED[name] if renamed else name
    flat, message = one_warning(padded(**{key: given}), {name: key} if renamed else None)
    assert flat.lags is None and flat.groups is None
    assert re.search(rf"'{key}'" + (rf" \(the {name} key\)" if renamed else "") + " " + described, message), message
    assert f"for a micro-batch of {B} datums" in message and OFF[name] in message
    assert "per-position" not in message and "padded [B, T]" not in message  # not a per-position field


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("field", "described"),
    [
        (None, r"datum 0's '{key}' is None"),
        ([], r"datum 0's '{key}' is empty \(a list of length 0\)"),
        ([[7]], r"datum 0's '{key}' is a list of shape \(1, 1\)"),
        ([1, 2], r"datum 0's '{key}' holds 2 values \(a list of length 2\)"),
        ({"v": 1}, r"datum 0's '{key}': expected a tensor, numpy array, list or TensorData, got dict"),
    ],
    ids=["None", "empty", "2-D", "two values", "a dict"],
)
def test_a_datum_field_that_is_none_empty_or_2d_names_the_datum_and_what_it_holds(
    name: str, field: Any, described: str
) -> None:
    flat, message = one_warning(datums(**{name: [field] * B}))
    assert flat.lags is None and flat.groups is None
    assert re.search(described.format(key=name), message), message
    assert f"for a micro-batch of {B} datums" in message and OFF[name] in message
    assert "more than one value" not in message and "per-position" not in message


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("step", "described"),
    [
        (lambda name: padded(**{name: [True, False, True]}), r"bools \(datum 0: True\)"),
        (lambda name: padded(**{name: [1, True, 0]}), r"bools \(datum 1: True\)"),
        (lambda name: padded(**{name: torch.ones(B, dtype=torch.bool)}), r"bools \(dtype torch.bool\)"),
        (lambda name: padded(**{name: np.ones(B, dtype=bool)}), r"bools \(dtype torch.bool\)"),
        (lambda name: datums(**{name: [True, True, False]}), r"bools \(datum 0: True\)"),
        (lambda name: datums(**{name: [[False]] * B}), r"bools \(datum 0: False\)"),
    ],
    ids=["list", "one in a list", "tensor", "numpy", "datum field", "datum one-value list"],
)
def test_bools_are_a_wrong_type_never_read_as_1_and_0(name: str, step: Any, described: str) -> None:
    """A version counts optimizer steps and a group is an id: ``True`` is neither, so it is never read as 1."""
    flat, message = one_warning(step(name))
    assert flat.lags is None and flat.groups is None
    assert re.search(rf"'{name}' must hold integers, got {described}", message), message
    assert OFF[name] in message


def test_a_list_with_none_says_none_not_nan() -> None:
    flat, message = one_warning(padded(policy_version=[3, None, None]))
    assert flat.lags is None
    assert "'policy_version' is None at datum 1 (2 of the 3 values)" in message, message
    assert "nan" not in message.lower()


def test_labels_of_the_wrong_count_are_a_count_not_a_mixed_kind() -> None:
    flat, message = one_warning(padded(group=["math", "code"]))
    assert flat.groups is None
    assert "'group' has 2 labels for 3 datums" in message and "must be one int" not in message, message


def test_usable_keys_are_read_without_a_word() -> None:
    flat, said = read(padded(policy_version=[5, 4.0, 0], group=torch.tensor([0, 1, 2])))
    assert said == [] and flat.lags.tolist() == [0, 1, 5] and flat.groups.tolist() == [0, 1, 2]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_a_tensor_without_data_on_the_meta_device_is_one_warning_and_its_family_off(
    name: str, dtype: torch.dtype
) -> None:
    flat, message = one_warning(padded(**{name: torch.zeros(B, dtype=dtype, device="meta")}))
    assert flat.lags is None and flat.groups is None
    assert f"'{name}' cannot be read from the meta device" in message and OFF[name] in message, message
    assert f"a tensor of shape (3,) and dtype {dtype}" in message, message


# --- advantages holding NaN -------------------------------------------------------------------

NAN = float("nan")


def nan_said(flat: FlatBatch, keys: dict[str, str] | None = None) -> str:
    """What the monitor says about NaN advantages from the statistics of ``flat`` (empty: nothing)."""
    host = DivergenceStats.from_batch(flat).to_host()
    return nan_advantages_message(host.totals, key_label(data_keys(keys), "advantages")) or ""


def test_nan_per_datum_advantages_are_counted_on_their_datums_positions() -> None:
    advantages = torch.tensor([1.0, NAN, -1.0])
    kept = advantages.clone()
    flat, said = read(padded(advantages=advantages), datum_advantages=True)
    assert said == []  # not read on the host: counted with the statistics
    message = nan_said(flat)
    assert f"'advantages' holds NaN on {T} of the {B * T} masked-in positions (mask > 0) of the step" in message
    assert "not action tokens" in message, message
    assert int(flat.counted.sum()) == 2 * T  # datum 1's tokens are not counted, as the warning says
    assert flat.datum_advantages.tolist() == [1.0, 0.0, -1.0]  # read as 0, as said
    assert torch.equal(advantages.isnan(), kept.isnan()) and torch.equal(advantages.nan_to_num(), kept.nan_to_num())


def test_nan_per_token_advantages_count_masked_in_positions_only() -> None:
    advantages = torch.ones(B, T)
    advantages[2, 1] = advantages[2, 3] = NAN
    advantages[0, 0] = NAN  # masked out below: it is no one's advantage
    mask = torch.ones(B, T)
    mask[0, 0] = 0.0
    output, batch = padded(advantages=advantages)
    batch["mask"] = mask
    flat, said = read((output, batch))
    assert said == []
    assert f"'advantages' holds NaN on 2 of the {B * T - 1} masked-in positions (mask > 0)" in nan_said(flat)
    only_masked_out = torch.ones(B, T)
    only_masked_out[0, 0] = NAN
    output, batch = padded(advantages=only_masked_out)
    batch["mask"] = mask
    assert nan_said(read((output, batch))[0]) == ""


def test_nan_advantages_of_datums_and_a_renamed_key_are_said() -> None:
    flat, _ = read(datums(advantages=[[1.0], [NAN], [None]]), datum_advantages=True)
    assert f"'advantages' holds NaN on {2 * T} of the {B * T} masked-in positions (mask > 0)" in nan_said(flat)
    assert int(flat.counted.sum()) == T and flat.datum_advantages.tolist() == [1.0, 0.0, 0.0]
    per_position = [[1.0] * T, [1.0, NAN, 1.0, 1.0], [1.0] * T]
    flat, _ = read(datums(advantages=per_position), datum_advantages=True)
    assert f"'advantages' holds NaN on 1 of the {B * T} masked-in positions (mask > 0)" in nan_said(flat)
    assert int(flat.counted.sum()) == B * T - 1 and flat.datum_advantages.tolist() == [1.0, 1.0, 1.0]
    renamed = {"advantages": "adv"}
    flat, _ = read(padded(adv=torch.tensor([NAN, 1.0, 2.0])), renamed)
    message = nan_said(flat, renamed)
    assert f"'adv' (the advantages key) holds NaN on {T} of the {B * T} masked-in positions (mask > 0)" in message


def test_bool_advantages_are_not_read_as_numbers_by_a_correction() -> None:
    flat, message = one_warning(padded(advantages=torch.tensor([True, False, True])), datum_advantages=True)
    assert "'advantages' holds bools (dtype torch.bool), not numbers" in message, message
    assert flat.datum_advantages.isnan().all()  # none usable: not kept by the correction, as the warning says


def test_a_datum_field_of_several_labels_is_said_as_several_values() -> None:
    """Labels are allowed: two of them are a count problem, not "expected a list of numbers"."""
    flat, message = one_warning(datums(group=[["math", "code"]] * B))
    assert flat.groups is None
    assert "datum 0's 'group' holds 2 values (a list of length 2)" in message and "list of numbers" not in message, message


@pytest.mark.parametrize("given", [[[1.0]] * B, "high"], ids=["nested list", "text"])
def test_advantages_beside_datums_that_cannot_be_read_are_said_not_raised(given: Any) -> None:
    """Only a correction reads advantages given next to datums: what it cannot read is one warning, never an error."""
    output, _ = datums()
    output["advantages"] = given
    flat, message = one_warning((output, None), datum_advantages=True)
    assert "needs one advantage per datum: 'advantages'" in message, message
    assert flat.datum_advantages.isnan().all()


def test_a_b_by_1_array_of_advantages_beside_datums_is_read_as_a_b_by_1_tensor_is() -> None:
    output, _ = datums()
    output["advantages"] = np.array([[1.0], [0.5], [-1.0]])
    flat, said = read((output, None), datum_advantages=True)
    assert not said and flat.datum_advantages.tolist() == [1.0, 0.5, -1.0]


def test_per_token_advantages_of_the_wrong_size_name_the_positions_the_datums_have() -> None:
    """Datums of different lengths: the step's positions in all, not a made-up row width."""
    output, _ = datums()
    output["data"][0]["loss_fn_inputs"] = {"logprobs": [-1.0] * 2, "mask": [1.0] * 2}
    output["data"][0]["model_input"] = [0, 1]
    output["training_logprobs"] = [torch.full((2,), -1.25)] + [torch.full((T,), -1.25)] * (B - 1)
    output["advantages"] = torch.ones(B, T)
    flat, message = one_warning((output, None), datum_advantages=True)
    positions = 2 + (B - 1) * T
    assert f"has shape ({B}, {T}) ({B * T} values) but the step's {B} datums have {positions} positions in all" in (
        message
    ), message
    assert flat.datum_advantages.isnan().all()


def test_a_renamed_advantages_field_of_datums_decides_the_action_tokens_as_the_corrections_read_it() -> None:
    """``keys={"advantages": "adv"}``: a datum whose ``adv`` is 0 has no action tokens, as with ``advantages``."""
    step = datums(adv=[[1.0], [0.0], [-1.0]])
    flat, said = read(step, {"advantages": "adv"}, datum_advantages=True)
    assert not said
    assert flat.active.reshape(B, T).all(dim=1).tolist() == [True, False, True]
    assert flat.datum_advantages.tolist() == [1.0, 0.0, -1.0]


@pytest.mark.parametrize("name", NAMES)
def test_a_datum_field_holding_none_says_none_not_nan(name: str) -> None:
    _, message = one_warning(datums(**{name: [[3], [None], [5]]}))
    assert "datum 1's" in message and "is [None]" in message and "nan" not in message, message
