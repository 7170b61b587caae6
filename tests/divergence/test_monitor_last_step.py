"""What a script reads of the last logged step: every number the loggers got (the diagnosis' and signature numbers
too) in ``last_metrics``, and the worst tokens in ``last_worst_tokens``, whatever the logger (a CSV file holds none)."""

from __future__ import annotations

import csv
import os
from typing import Any

from lightning.pytorch.loggers import CSVLogger

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.monitor import MediaOptions
from loops_callbacks.divergence.report import WORST_TOKEN_COLUMNS
from tests.helpers import RecordingLogger, TinyPolicy, quiet_trainer
from tests.oracle import PREFIX

K3 = PREFIX + "kl_sample_train_k3"


def test_last_metrics_hold_the_diagnosis_and_signature_numbers_under_their_logged_keys() -> None:
    logger, monitor = RecordingLogger(), KLSampleTrainMonitor(log_every_n_steps=1)
    quiet_trainer(max_steps=2, logger=logger, callbacks=[monitor]).fit(TinyPolicy(offset=0.3))
    logged = [metrics for _, metrics in logger.calls if K3 in metrics][-1]
    for key in (PREFIX + "signature/relative_gap", PREFIX + "signature/pearson", PREFIX + "diagnosis/confidence",
                PREFIX + f"diagnosis/{monitor.last_diagnosis.cause}"):
        assert key in monitor.last_metrics, key
    assert monitor.last_metrics[PREFIX + f"diagnosis/{monitor.last_diagnosis.cause}"] == 1.0
    assert monitor.last_metrics == logged


def test_the_worst_tokens_are_the_monitor_s_with_a_csv_logger_which_writes_none(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = KLSampleTrainMonitor(log_every_n_steps=1, media=MediaOptions(top_n=5))
    quiet_trainer(max_steps=2, logger=logger, callbacks=[monitor]).fit(TinyPolicy(offset=0.3))
    rows = monitor.last_worst_tokens
    assert len(rows) == 5 and [row["rank"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(list(row) == WORST_TOKEN_COLUMNS for row in rows)
    assert rows[0]["diff"] == max((row["diff"] for row in rows), key=abs)
    with open(os.path.join(logger.log_dir, "metrics.csv")) as handle:
        columns = next(csv.reader(handle))
    assert K3 in columns and not any("worst" in column for column in columns)
    quiet = KLSampleTrainMonitor(log_every_n_steps=1, media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=1, callbacks=[quiet]).fit(TinyPolicy(offset=0.3))
    assert quiet.last_worst_tokens == []


def test_an_unclear_step_says_where_its_worst_tokens_are() -> None:
    message = Diagnosis("unclear", 0.0, {"relative_gap": 0.2}).message
    assert "worst_tokens" in message and "last_worst_tokens" in message, message
