"""Hand-computed worst-token rows, every promised error, and the W&B side of loops_log_kl_sample_train."""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

import numpy as np
import pytest
import torch

from loops_callbacks import loops_compute_kl_sample_train, loops_log_kl_sample_train
from loops_callbacks.types import Datum, ForwardBackwardOutput, ModelInput, TensorData

P = "optim/train-sample-div/"


class Letters:
    """Decodes id i as the i-th lower-case letter."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in token_ids)


class Broken:
    def decode(self, token_ids: list[int]) -> str:
        raise KeyError("no such token")


class Escapes:
    def decode(self, token_ids: list[int]) -> str:
        return {7: "x\ty", 8: "\\", 9: "line\nbreak\r"}.get(token_ids[0], "?") if len(token_ids) == 1 else "-"


def datum(tokens: list[int], sampler: list[float | None], **extra: Any) -> Datum:
    return Datum(ModelInput.from_ints(tokens), {"logprobs": sampler, "mask": [1.0] * len(tokens), **extra})


def table_rows(data: list[Datum], trainer: list[list[float]], **kwargs: Any) -> list[list[Any]]:
    return loops_log_kl_sample_train(None, 0, data, training_logprobs=trainer, **kwargs)[P + "worst_tokens"].data


def test_rows_by_hand_with_a_tokenizer() -> None:
    data = [datum(list(range(10)), [-1.0] * 10)]
    trainer = [[-1.0] * 10]
    trainer[0][4] = -3.0  # d = -2 at k = 4: the token predicted there is model_input[5]
    trainer[0][9] = -0.5  # d = +0.5 at the last position: no next token -> <end>
    rows = table_rows(data, trainer, top_n=2, tokenizer=Letters())
    assert rows == [
        [1, 0, 5, "f", -1.0, -3.0, -2.0, round(math.exp(-2.0), 4), "ab⟦cde»f«ghi⟧j"],
        [2, 0, 10, "<end>", -1.0, -0.5, 0.5, round(math.exp(0.5), 4), "abcdefg⟦hij»<end>«⟧"],
    ]


def test_rows_by_hand_without_a_tokenizer_and_with_target_tokens() -> None:
    tokens = list(range(50, 110))  # 60 tokens: the context window is cut at 40 before and 20 after
    data = [datum(tokens, [-1.0] * 60, target_tokens=[t + 1000 for t in tokens])]
    trainer = [[-1.0] * 60]
    trainer[0][44] = -1.25
    (row,) = table_rows(data, trainer, top_n=1)
    assert row[:8] == [1, 0, 45, "1094", -1.0, -1.25, -0.25, round(math.exp(-0.25), 4)]
    before = " ".join(map(str, range(55, 92)))  # model_input[5:42], then the 3 near tokens 92..94
    after = " ".join(map(str, range(99, 110)))  # model_input[49:60]: the 20 after are cut by the end
    assert row[8] == f"{before}⟦92 93 94»95«96 97 98⟧{after}"  # the context is model_input's, as the SDK's


def test_a_tokenizer_that_raises_falls_back_to_ids_and_text_is_escaped() -> None:
    data = [datum([7, 8, 9, 1], [-1.0, -1.0, -1.0, -1.0])]
    rows = table_rows(data, [[-1.0, -2.0, -1.0, -1.0]], top_n=1, tokenizer=Broken())
    assert rows[0][3] == "9" and rows[0][8] == "⟦7 8»9«1⟧"
    rows = table_rows(data, [[-1.0, -2.0, -1.0, -1.0]], top_n=1, tokenizer=Escapes())
    assert rows[0][3] == "line\nbreak\r"  # the token cell is decode([id]) itself, as in the SDK
    assert rows[0][8] == "⟦-»line\\nbreak\\r«?⟧"
    rows = table_rows(data, [[-3.0, -1.0, -1.0, -1.0]], top_n=1, tokenizer=Escapes())
    assert rows[0][8] == "⟦x\\ty»\\\\«-⟧"


@pytest.mark.parametrize(
    "tokenizer, tokens, want",
    [
        (Letters(), [0, 1, 2], ["b", "c", "<end>"]),  # decode([id])
        (None, [0, 49947, 2], ["49947", "2", "<end>"]),  # the id as a decimal string
        (Broken(), [0, 49947, 2], ["49947", "2", "<end>"]),  # a tokenizer that cannot decode: the id
    ],
)
def test_the_token_column_is_text_in_every_case(tokenizer: Any, tokens: list[int], want: list[str]) -> None:
    """The SDK's token column: never an int, so a W&B column never mixes ints and text."""
    data = [datum(tokens, [-1.0, -1.0, -1.0])]
    rows = table_rows(data, [[-4.0, -3.0, -2.0]], top_n=3, tokenizer=tokenizer)
    assert [row[3] for row in rows] == want
    assert all(type(row[3]) is str for row in rows)


def test_each_row_carries_its_own_diff_and_weight() -> None:
    data = [datum([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0])]
    rows = table_rows(data, [[-1.5, -4.0, -1.0, -0.25]], top_n=4)
    assert [row[6] for row in rows] == [-3.0, 0.75, -0.5, 0.0]
    assert [row[7] for row in rows] == [round(math.exp(d), 4) for d in (-3.0, 0.75, -0.5, 0.0)]


# --- errors ------------------------------------------------------------------------------------


def good() -> Datum:
    return datum([1, 2, 3], [None, -1.0, -2.0])


@pytest.mark.parametrize(
    "data, trainer, error, pattern",
    [
        ([good(), good()], [[0.0, -1.0, -2.0]], ValueError, r"len\(data\) = 2 but training_logprobs has 1 rows"),
        ([Datum(ModelInput.from_ints([1]), {"mask": [1.0]})], [[0.0]], ValueError, r"datum 0: loss_fn_inputs has no 'logprobs'"),
        ([Datum(ModelInput.from_ints([1]), {"logprobs": [0.0]})], [[0.0]], ValueError, r"datum 0: loss_fn_inputs has no 'mask'"),
        ([good(), good()], [[0.0, -1.0, -2.0], [0.0, -1.0]], ValueError,
         r"datum 1: lengths differ: loss_fn_inputs\['logprobs'\] has 3, loss_fn_inputs\['mask'\] has 3, "
         r"training_logprobs\[1\] has 2"),
        ([datum([1, 2, 3], [None, -1.0, -2.0], advantages=[1.0, 2.0])], [[0.0, -1.0, -2.0]], ValueError,
         r"datum 0: loss_fn_inputs\['advantages'\] has length 2, expected 1 .* or 3"),
        ([Datum(ModelInput.from_ints([1, 2]), {"logprobs": [0.0, -1.0], "mask": [1.0, 1.0, 1.0]})], [[0.0, -1.0]],
         ValueError, r"datum 0: lengths differ: .* loss_fn_inputs\['mask'\] has 3"),
        ([Datum(ModelInput.from_ints([1, 2, 3, 4]), {"logprobs": [0.0, -1.0], "mask": [1.0, 1.0]})], [[0.0, -1.0]],
         ValueError, r"datum 0: lengths differ: loss_fn_inputs\['logprobs'\] has 2, .* model_input has 4"),
        ([Datum(ModelInput.from_ints([1, 2]), {"logprobs": [0.0, -1.0], "mask": [1.0, 1.0], "target_tokens": [2]})],
         [[0.0, -1.0]], ValueError, r"datum 0: lengths differ: .* loss_fn_inputs\['target_tokens'\] has 1"),
        ([good()], torch.zeros(1, 2), ValueError, r"datum 0: lengths differ: .* has 3, .* training_logprobs\[0\] has 2"),
        ([Datum(ModelInput.from_ints([1]), {"logprobs": "oops", "mask": [1.0]})], [[0.0]], TypeError,
         r"datum 0, key 'logprobs': expected a tensor, numpy array, list or TensorData, got str"),
        ([Datum(ModelInput.from_ints([1]), {"logprobs": [["a"]], "mask": [1.0]})], [[0.0]], TypeError,
         r"datum 0, key 'logprobs': expected a list of numbers"),
        ([Datum(ModelInput.from_ints([1, 2]), {"logprobs": torch.zeros(2, 1), "mask": [1.0, 1.0]})], [[0.0, 0.0]],
         ValueError, r"datum 0, key 'logprobs': expected a 1-D per-position field, got shape \(2, 1\)"),
        (["not a datum"], [[0.0]], TypeError, r"datum 0: expected a Datum with a loss_fn_inputs mapping, got str"),
        # logprobs in an integer dtype (a zeros_like of the token ids) were never logprobs
        ([Datum(ModelInput.from_ints([1, 2]), {"logprobs": np.zeros(2, dtype=np.int64), "mask": [1.0, 1.0]})],
         [[0.0, -1.0]], TypeError, r"datum 0: loss_fn_inputs\['logprobs'\] must hold floating-point logprobs .*int64"),
        ([Datum(ModelInput.from_ints([1, 2]), {"logprobs": [0.0, -1.0], "mask": [1.0, 1.0]})],
         [torch.tensor([0, -1])], TypeError, r"training_logprobs\[0\] must hold floating-point logprobs"),
        ([good()], torch.zeros(1, 3, dtype=torch.long), TypeError, r"training_logprobs must hold floating-point"),
    ],
)
def test_bad_input_names_the_datum_key_and_lengths(data: Any, trainer: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        loops_compute_kl_sample_train(data, trainer)


def test_log_errors() -> None:
    with pytest.raises(ValueError, match="pass either forward_backward_output or training_logprobs"):
        loops_log_kl_sample_train(None, 0, [good()])
    with pytest.raises(ValueError, match=r"loss_fn_outputs items \[1\] have no 'logprobs'"):
        output = ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [0.0, -1.0, -2.0]}, {"elementwise_loss": [0.0]}])
        loops_log_kl_sample_train(None, 0, [good(), good()], output)
    with pytest.raises(ValueError, match="top_n must be an int >= 0, got -1"):
        loops_log_kl_sample_train(None, 0, [good()], training_logprobs=[[0.0, -1.0, -2.0]], top_n=-1)
    with pytest.raises(TypeError, match="forward_backward_output has no loss_fn_outputs"):  # not an output at all
        loops_log_kl_sample_train(None, 0, [good()], {"logprobs": [0.0, -1.0, -2.0]})


def test_training_logprobs_win_over_the_output() -> None:
    ignored = ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [0.0, 0.0, 0.0]}])
    got = loops_log_kl_sample_train(None, 0, [good()], ignored, training_logprobs=[[0.0, -1.5, -2.0]])
    assert got[P + "diff_mean"] == -0.25


# --- sinks -------------------------------------------------------------------------------------


class FakeRun:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[dict[str, Any], int]] = []
        self.fail = fail

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.fail:
            raise ConnectionError("W&B is unreachable")
        self.calls.append((metrics, step))


def test_a_fake_run_records_the_dict_at_the_step() -> None:
    run = FakeRun()
    got = loops_log_kl_sample_train(run, 17, [good()], training_logprobs=[[0.0, -1.5, -2.0]])
    assert run.calls == [(got, 17)]
    assert loops_log_kl_sample_train(None, 17, [good()], training_logprobs=[[0.0, -1.5, -2.0]]).keys() == got.keys()


def test_a_failing_run_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="loops_callbacks"):
        got = loops_log_kl_sample_train(FakeRun(fail=True), 3, [good()], training_logprobs=[[0.0, -1.5, -2.0]])
    assert "could not log divergence metrics to W&B at step 3" in caplog.text
    assert got[P + "n_action_tokens"] == 2.0


def test_a_real_offline_run_accepts_the_dict_and_writes_the_table(tmp_path: Any) -> None:
    import wandb

    run = wandb.init(mode="offline", dir=str(tmp_path), project="loops-callbacks-tests")
    data = [datum(list(range(20)), [-1.0] * 20, target_tokens=list(range(1, 21))) for _ in range(3)]
    trainer = [list(np.linspace(-2.0, 0.0, 20)) for _ in range(3)]
    loops_log_kl_sample_train(run, 5, data, training_logprobs=trainer, tokenizer=Letters())
    run_dir = run.dir
    run.finish()
    (table,) = glob.glob(os.path.join(run_dir, "media", "table", "**", "*.table.json"), recursive=True)
    with open(table) as handle:
        content = json.load(handle)
    assert content["columns"][-1] == "context" and len(content["data"]) == 20
    assert content["data"][0][8].count("⟦") == 1  # decoded context text
    assert all(isinstance(row[3], str) for row in content["data"])  # the token column is text, one type


def test_tensor_data_round_trip_keeps_none() -> None:
    data = TensorData.from_torch(torch.tensor([0.5, float("nan"), -1.0]))
    assert data.data == [0.5, None, -1.0] and data.shape == [3]
    assert torch.equal(data.to_torch().nan_to_num(7.0), torch.tensor([0.5, 7.0, -1.0]))
    assert ModelInput.from_ints([1, 2]).append_int(3).length == 3
