"""The two Loops functions against the per-token oracle, over every accepted input form."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loops_callbacks import loops_compute_kl_sample_train, loops_log_kl_sample_train
from loops_callbacks.rl_metrics import loops_log_kl_sample_train as log_from_module
from loops_callbacks.types import Datum, ForwardBackwardOutput, ModelInput
from tests import oracle
from tests.helpers import as_datums, assert_metrics_equal, rounded, rows

P = oracle.PREFIX
SDK_KEYS = [
    "kl_sample_train_v1_loops", "kl_sample_train_v2_loops", "kl_sample_train_k3", "is_ratio_mean",
    "ess_fraction", "diff_mean", "diff_abs_p50", "diff_abs_p90", "diff_abs_p99", "diff_abs_max",
    "frac_abs_gt_1", "frac_abs_gt_2", "frac_abs_gt_4", "entropy", "n_action_tokens",
]


# --- generated batches ------------------------------------------------------------------------


FORMS = {"lists": torch.float64, "tensor_data": torch.float32, "numpy": torch.float32,
         "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=rows(), form=st.sampled_from(sorted(FORMS)))
def test_scalars_agree_with_the_oracle_for_every_input_form(batch: list[dict[str, Any]], form: str) -> None:
    datums, trainer = as_datums(batch, form)
    # Sampler values stay float64 for lists/numpy, so round only what the form rounds.
    expected_rows = rounded(batch, FORMS[form]) if form not in ("lists",) else batch
    if form == "numpy":  # sampler float64, trainer float32
        expected_rows = [dict(r, trainer=t["trainer"]) for r, t in zip(batch, rounded(batch, torch.float32))]
    if form == "tensor_data":  # our TensorData keeps the Python floats whatever its dtype label
        expected_rows = batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or conversion warnings
        got = loops_compute_kl_sample_train(datums, trainer)
    assert_metrics_equal(got, oracle.metrics(expected_rows))


NEARLY_EQUAL_DIFFS = [{  # two diffs one ulp apart: numpy cannot make 64 finite bins of their range
    "tokens": [0, 0, 0], "logprobs": [None, -6.0, 0.0], "mask": [0.0, 1.0, 1.0],
    "trainer": [None, -4.0969236166365555, 1.903076383363444]}]


@settings(max_examples=40, deadline=None)
@given(batch=rows(), top_n=st.integers(0, 8), max_hist=st.integers(-1, 10))
@example(batch=NEARLY_EQUAL_DIFFS, top_n=0, max_hist=0)
def test_log_histogram_and_table_agree_with_the_oracle(batch: list[dict[str, Any]], top_n: int, max_hist: int) -> None:
    datums, trainer = as_datums(batch, "lists")
    output = ForwardBackwardOutput(loss=0.0, loss_fn_output_type="x", loss_fn_outputs=[{"logprobs": t} for t in trainer])
    got = loops_log_kl_sample_train(None, 3, datums, output, top_n=top_n, max_histogram_tokens=max_hist)
    assert_metrics_equal(got, oracle.metrics(batch))
    if got[P + "n_action_tokens"] == 0:
        assert P + "worst_tokens" not in got and P + "per_token_diff_hist" not in got
        return
    assert got[P + "worst_tokens"].data == oracle.worst_rows(batch, top_n)
    hist = got[P + "per_token_diff_hist"]
    diffs = np.asarray(oracle.histogram(batch, max_hist))
    try:
        want = np.histogram(diffs, bins=64)
    except ValueError:  # a few ulps apart: centred in a range of 1, as numpy centres equal values
        middle = diffs.min() / 2 + diffs.max() / 2
        want = np.histogram(diffs, bins=64, range=(middle - 0.5, middle + 0.5))
        assert sum(hist.histogram) == len(diffs)
    assert hist.histogram == want[0].tolist()
    assert hist.bins == pytest.approx(want[1].tolist())


def test_sentinel_logprobs_a_few_ulps_apart_still_give_a_histogram() -> None:
    """At |d| near 1e15 a range of 1 is under 64 ulps: the histogram must still come, since training goes on."""
    datums = [Datum(ModelInput.from_ints([1, 2, 3, 4]), {"logprobs": [-1e15] * 4, "mask": [1.0] * 4})]
    got = loops_log_kl_sample_train(None, 0, datums, training_logprobs=[[-0.5, -1.25, -3.0, -2.0]])
    assert sum(got[P + "per_token_diff_hist"].histogram) == 4 and got[P + "n_action_tokens"] == 4


def test_padded_trainer_tensor_and_mapping_datums_read_like_rows() -> None:
    datums = [
        {"model_input": ModelInput.from_ints([1, 2, 3]), "loss_fn_inputs": {"logprobs": [None, -1.0, -2.0], "mask": [0, 1, 1]}},
        {"model_input": ModelInput.from_ints([4]), "loss_fn_inputs": {"logprobs": [-0.5], "mask": [1]}},
    ]
    padded = torch.tensor([[0.0, -1.25, -2.5], [-0.75, 99.0, 99.0]])
    got = loops_compute_kl_sample_train(datums, padded)
    want = oracle.metrics([
        {"logprobs": [None, -1.0, -2.0], "mask": [0, 1, 1], "trainer": [0.0, -1.25, -2.5]},
        {"logprobs": [-0.5], "mask": [1], "trainer": [-0.75]},
    ])
    assert_metrics_equal(got, want)


def test_tinker_datums_and_outputs_are_accepted_unchanged() -> None:
    tinker = pytest.importorskip("tinker", reason="the tinker package is in the dev extra")
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={
            "logprobs": tinker.TensorData(data=[0.0, -1.0, -2.0, -0.5], dtype="float32", shape=[4]),
            "mask": tinker.TensorData(data=[0.0, 1.0, 1.0, 1.0], dtype="float32", shape=[4]),
            "advantages": tinker.TensorData(data=[1.0, 1.0, 0.0, 1.0], dtype="float32", shape=[4]),
            "target_tokens": tinker.TensorData(data=[6, 7, 8, 9], dtype="int64", shape=[4]),
        },
    )
    trainer = tinker.TensorData(data=[0.0, -1.5, 0.0, -0.25], dtype="float32", shape=[4])
    output = tinker.ForwardBackwardOutput(loss_fn_output_type="x", loss_fn_outputs=[{"logprobs": trainer}])
    got = loops_log_kl_sample_train(None, 0, [datum], output, top_n=5)
    row = {"logprobs": [0.0, -1.0, -2.0, -0.5], "mask": [0, 1, 1, 1], "advantages": [1, 1, 0, 1],
           "trainer": [0.0, -1.5, 0.0, -0.25], "tokens": [5, 6, 7, 8], "target_tokens": [6, 7, 8, 9]}
    assert_metrics_equal(got, oracle.metrics([row]))
    assert got[P + "worst_tokens"].data == oracle.worst_rows([row], 5)


def test_no_action_tokens_gives_only_the_counts() -> None:
    datum = Datum(ModelInput.from_ints([1, 2]), {"logprobs": [None, -1.0], "mask": [0.0, 1.0], "advantages": [0.0]})
    assert loops_compute_kl_sample_train([datum], [[0.0, -2.0]]) == {
        P + "n_action_tokens": 0.0, P + "n_sequences": 1.0, P + "n_skipped_nonfinite": 0.0,
    }
    assert loops_compute_kl_sample_train([], []) == {
        P + "n_action_tokens": 0.0, P + "n_sequences": 0.0, P + "n_skipped_nonfinite": 0.0,
    }


def test_nonfinite_logprobs_are_counted_not_lost() -> None:
    datum = Datum(ModelInput.from_ints([1, 2, 3, 4]), {"logprobs": [None, -1.0, None, -1.0], "mask": [1, 1, 1, 1]})
    got = loops_compute_kl_sample_train([datum], [[0.0, math.nan, -1.0, -1.0]])
    assert got[P + "n_skipped_nonfinite"] == 3.0 and got[P + "n_action_tokens"] == 1.0


def test_extreme_diffs_stay_finite_without_warnings() -> None:
    datum = Datum(ModelInput.from_ints([1, 2, 3]), {"logprobs": [-1000.0, 0.0, -5.0], "mask": [1, 1, 1]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = loops_log_kl_sample_train(None, 0, [datum], training_logprobs=[[0.0, -1000.0, -5.0]])
    scalars = {k: v for k, v in got.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in scalars.values())
    assert scalars[P + "is_ratio_max"] == math.exp(80.0)
    assert got[P + "worst_tokens"].data[0][7] == round(math.exp(80.0), 4)


def test_all_zero_trainer_logprobs_warn_and_still_return(caplog: pytest.LogCaptureFixture) -> None:
    datum = Datum(ModelInput.from_ints([1, 2]), {"logprobs": [-1.0, -2.0], "mask": [1, 1]})
    with caplog.at_level("WARNING", logger="loops_callbacks"):
        got = loops_compute_kl_sample_train([datum], [[0.0, 0.0]])
    assert "exactly 0.0" in caplog.text
    assert got[P + "diff_mean"] == 1.5


def test_inputs_are_not_modified() -> None:
    datums, trainer = as_datums(
        [{"tokens": [1, 2, 3], "logprobs": [None, -1.0, -2.0], "mask": [0, 1, 1], "advantages": [1.0],
          "target_tokens": [2, 3, 4], "trainer": [0.0, -1.0, -3.0]}], "float32"
    )
    before = copy.deepcopy((datums, trainer))
    loops_log_kl_sample_train(None, 0, datums, training_logprobs=trainer)
    for (d0, t0), (d1, t1) in zip(zip(*before), zip(datums, trainer)):
        assert d0.model_input == d1.model_input and torch.equal(t0.nan_to_num(), t1.nan_to_num())
        for key in d0.loss_fn_inputs:
            assert torch.equal(d0.loss_fn_inputs[key].nan_to_num(), d1.loss_fn_inputs[key].nan_to_num())


def test_log_function_is_exported_from_both_paths() -> None:
    assert log_from_module is loops_log_kl_sample_train


@settings(max_examples=40, deadline=None)
@given(batch=rows(), top_n=st.integers(0, 6))
def test_accelerator_code_path_gives_the_same_results(batch: list[dict[str, Any]], top_n: int) -> None:
    """The fixed-shape (no host sync) path used on accelerators, run on the CPU."""
    from unittest import mock

    from loops_callbacks.divergence import statistics as sums

    datums, trainer = as_datums(batch, "lists")
    with mock.patch.object(sums, "_on_host", return_value=False):
        got = loops_log_kl_sample_train(None, 0, datums, training_logprobs=trainer, top_n=top_n)
    assert_metrics_equal(got, oracle.metrics(batch))
    if got[P + "n_action_tokens"]:
        assert got[P + "worst_tokens"].data == oracle.worst_rows(batch, top_n)
