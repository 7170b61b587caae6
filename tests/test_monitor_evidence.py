"""The monitor reads what it can see directly about the trainer (live dropout) on each logged step."""

from __future__ import annotations

from torch import nn

from loops_callbacks import KLSampleTrainMonitor
from tests.helpers import TinyPolicy, quiet_trainer


class DropoutPolicy(TinyPolicy):
    """TinyPolicy, diverging, with a dropout layer left in training mode."""

    def __init__(self) -> None:
        super().__init__(offset=0.3)
        self.dropout = nn.Dropout(0.1)


def test_live_dropout_in_the_module_is_named_by_the_monitor() -> None:
    monitor = KLSampleTrainMonitor(log_worst_tokens=False)
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(DropoutPolicy())
    assert monitor.last_diagnosis.cause == "dropout"
    assert "1 Dropout module with p = 0.1" in monitor.last_diagnosis.message


def test_without_dropout_the_statistical_cause_stays() -> None:
    monitor = KLSampleTrainMonitor(log_worst_tokens=False)
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(TinyPolicy(offset=0.3))
    assert monitor.last_diagnosis.cause != "dropout"
