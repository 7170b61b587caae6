"""The monitor reads what it can see directly about the trainer (live dropout) on each logged step, and
gives each report the run's context (per-lag numbers, offset votes, the trend of the relative gap)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback
from torch import nn

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.monitor import MediaOptions
from tests.helpers import TinyPolicy, quiet_trainer
from tests.oracle import PREFIX


class DropoutPolicy(TinyPolicy):
    """TinyPolicy, diverging, with a dropout layer left in training mode."""

    def __init__(self) -> None:
        super().__init__(offset=0.3)
        self.dropout = nn.Dropout(0.1)


def test_live_dropout_in_the_module_is_named_by_the_monitor() -> None:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(DropoutPolicy())
    assert monitor.last_diagnosis.cause == "dropout"
    assert "1 Dropout module with p = 0.1" in monitor.last_diagnosis.message


def test_without_dropout_the_statistical_cause_stays() -> None:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(TinyPolicy(offset=0.3))
    assert monitor.last_diagnosis.cause != "dropout"


def test_each_report_gets_the_evidence_and_the_relative_gaps_of_the_previous_logged_steps(monkeypatch: Any) -> None:
    from loops_callbacks.divergence import monitor as monitor_module

    seen: list[dict[str, Any]] = []
    real = monitor_module.step_report

    def spy(host: Any, *args: Any, **options: Any) -> Any:
        # the run's calibration, as it stands when this step is reported (it learns from the step afterwards)
        seen.append({**options, "trend": list(options["calibration"].recent_gaps)})
        return real(host, *args, **options)

    monkeypatch.setattr(monitor_module, "step_report", spy)
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    history = []

    class Gap(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            history.append(float(trainer.callback_metrics[PREFIX + "signature/relative_gap"]))

    quiet_trainer(max_steps=3, callbacks=[monitor, Gap()]).fit(TinyPolicy(offset=0.3))
    # callback_metrics hold float32: equal to the float64 gaps the trend keeps within float32's rounding
    assert [list(options["trend"]) for options in seen] == [[], pytest.approx(history[:1], rel=1e-6),
                                                           pytest.approx(history[:2], rel=1e-6)]
    assert all(options["evidence"] is not None for options in seen)
