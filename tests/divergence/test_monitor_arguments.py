"""KLSampleTrainMonitor's constructor and its option groups name the argument they reject.

A wrong type is a TypeError, a value out of range a ValueError.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.monitor import GuardRail, MediaOptions

WRONG_TYPE = [
    (GuardRail, "max_kl", "0.05"),
    (GuardRail, "max_kl", True),
    (GuardRail, "max_nonfinite_fraction", "0.01"),
    (GuardRail, "patience", "2"),
    (GuardRail, "kl_metric", 3),
    (GuardRail, "on_exceed", 1),
    (MediaOptions, "max_histogram_tokens", "50000"),
    (MediaOptions, "max_histogram_tokens", 1.5),
    (MediaOptions, "top_n", "20"),
    (MediaOptions, "log_histogram", "no"),
    (MediaOptions, "log_worst_tokens", 0),
    (MediaOptions, "log_strata", 1),
    (MediaOptions, "max_groups", 8.0),
    (KLSampleTrainMonitor, "log_every_n_steps", 2.0),
    (KLSampleTrainMonitor, "sample_size", 1e5),
    (KLSampleTrainMonitor, "calibration_steps", None),
    (KLSampleTrainMonitor, "diagnose", "yes"),
    (KLSampleTrainMonitor, "prefix", None),
    (KLSampleTrainMonitor, "guard_rail", {"max_kl": 0.05}),
    (KLSampleTrainMonitor, "media", {"top_n": 5}),
    (KLSampleTrainMonitor, "tokenizer", object()),
]
OUT_OF_RANGE = [
    (GuardRail, "max_kl", -0.1),
    (GuardRail, "max_kl", math.nan),
    (GuardRail, "max_nonfinite_fraction", 1.5),
    (GuardRail, "max_nonfinite_fraction", -0.01),
    (GuardRail, "max_sampling_z", -1.0),
    (GuardRail, "patience", 0),
    (GuardRail, "on_exceed", "halt"),
    (MediaOptions, "top_n", -1),
    (MediaOptions, "max_groups", 0),
    (KLSampleTrainMonitor, "log_every_n_steps", 0),
    (KLSampleTrainMonitor, "sample_size", 0),
    (KLSampleTrainMonitor, "calibration_steps", -1),
    (KLSampleTrainMonitor, "interval", "epoch"),
]


@pytest.mark.parametrize(("owner", "name", "value"), WRONG_TYPE)
def test_a_wrong_type_is_a_type_error_naming_the_argument(owner: type, name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"^{name} must"):
        owner(**{name: value})


@pytest.mark.parametrize(("owner", "name", "value"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_a_value_error_naming_the_argument(owner: type, name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        owner(**{name: value})


def test_a_watched_metric_the_monitor_does_not_log_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^kl_metric='kl_k3' is not a metric the monitor logs"):
        KLSampleTrainMonitor(guard_rail=GuardRail(kl_metric="kl_k3"))


def test_numbers_of_any_real_type_are_accepted_as_floats() -> None:
    rail = GuardRail(max_kl=np.float32(0.5), max_nonfinite_fraction=0)
    monitor = KLSampleTrainMonitor(guard_rail=rail, media=MediaOptions(max_histogram_tokens=-1))
    assert monitor.guard_rail.max_kl == 0.5 and type(monitor.guard_rail.max_kl) is float
    assert monitor.guard_rail.max_nonfinite_fraction == 0.0
    assert KLSampleTrainMonitor().guard_rail.max_kl is None
