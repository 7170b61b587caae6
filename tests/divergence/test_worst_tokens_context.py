"""The worst-tokens table's ``context`` column is ``model_input`` alone, as in the Loops SDK.

The ``token`` column holds ``target_tokens[k]``; the context shows ``model_input`` around index
k + 1, with ``»<end>«`` past a datum's end, even where the target differs from ``model_input[k + 1]``
(the last position, shifted targets). Checked by hand, against the per-token oracle, through the
plain function and through the monitor's TensorBoard table.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from loops_callbacks import KLSampleTrainMonitor, loops_log_kl_sample_train
from loops_callbacks.divergence.report import worst_tokens_markdown
from loops_callbacks.types import Datum, ModelInput
from loops_callbacks.divergence.monitor import MediaOptions
from tests import oracle
from tests.helpers import LENGTH, TinyPolicy, quiet_trainer

P = oracle.PREFIX
SHIFT = 100


def test_the_last_position_and_shifted_targets_show_model_input_by_hand() -> None:
    row = {
        "tokens": [10, 11, 12, 13],
        "target_tokens": [21, 22, 23, 24],  # never model_input[k + 1]
        "logprobs": [-1.0, -1.0, -1.0, -1.0],
        "mask": [0.0, 1.0, 0.0, 1.0],
        "trainer": [-1.0, -1.5, -1.0, -3.0],
    }
    datum = Datum(ModelInput.from_ints(row["tokens"]), {k: row[k] for k in ("logprobs", "mask", "target_tokens")})
    got = loops_log_kl_sample_train(None, 0, [datum], training_logprobs=[row["trainer"]], top_n=2)
    table = got[P + "worst_tokens"].data
    assert table == [
        [1, 0, 4, "24", -1.0, -3.0, -2.0, round(math.exp(-2.0), 4), "10⟦11 12 13»<end>«⟧"],
        [2, 0, 2, "22", -1.0, -1.5, -0.5, round(math.exp(-0.5), 4), "⟦10 11»12«13⟧"],
    ]
    assert table == oracle.worst_rows([row], top_n=2)


class ShiftedTargets(TinyPolicy):
    """Returns target tokens that are not ``input_ids`` shifted by one (the table reads the output first)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {**super().training_step(batch, batch_idx), "target_tokens": batch["target_tokens"] + SHIFT}


def oracle_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "logprobs": record["sampler"][i].tolist(),
            "trainer": record["trainer"][i].tolist(),
            "mask": record["mask"][i].tolist(),
            "advantages": [float(record["advantages"][i])],
            "tokens": record["input_ids"][i].tolist(),
            "target_tokens": (record["target_tokens"][i] + SHIFT).tolist(),
        }
        for i in range(record["sampler"].shape[0])
    ]


class ShiftedTargetDatums(TinyPolicy):
    """The Loops form: the step's datums (with shifted ``target_tokens``) under ``data``, trainer rows beside."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        record = self.recorded[-1]
        keys = ("logprobs", "mask", "advantages", "target_tokens")
        data = [Datum(ModelInput.from_ints(row["tokens"]), {k: row[k] for k in keys}) for row in oracle_rows(record)]
        return {"loss": out["loss"], "data": data, "training_logprobs": list(record["trainer"])}


@pytest.mark.parametrize("policy", [ShiftedTargets, ShiftedTargetDatums])
def test_the_monitors_table_shows_model_input_at_the_last_position_and_with_shifted_targets(
    tmp_path: Any, policy: type[TinyPolicy]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    model = policy()
    top_n = 4 * LENGTH  # every action token of the step
    trainer = quiet_trainer(max_steps=1, logger=logger, callbacks=[KLSampleTrainMonitor(
        media=MediaOptions(top_n=top_n))])
    trainer.fit(model)
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0}).Reload()
    [tag] = [t for t in events.Tags()["tensors"] if t.startswith(P + "worst_tokens")]
    [event] = events.Tensors(tag)
    logged = event.tensor_proto.string_val[0].decode()
    want = oracle.worst_rows(oracle_rows(model.recorded[0]), top_n=top_n)
    assert any(row[2] == LENGTH and row[8].endswith("»<end>«⟧") for row in want)  # the last position is there
    assert logged == worst_tokens_markdown(want)
