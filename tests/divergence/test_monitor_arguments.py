"""KLSampleTrainMonitor's constructor names the argument it rejects.

A wrong type is a TypeError, a value out of range a ValueError.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from loops_callbacks import KLSampleTrainMonitor

WRONG_TYPE = [
    ("max_kl", "0.05"),
    ("max_kl", True),
    ("max_nonfinite_fraction", "0.01"),
    ("log_every_n_steps", 2.0),
    ("max_histogram_tokens", "50000"),
    ("max_histogram_tokens", 1.5),
    ("top_n", "20"),
    ("sample_size", 1e5),
    ("patience", "2"),
    ("calibration_steps", None),
    ("log_histogram", "no"),
    ("log_worst_tokens", 0),
    ("diagnose", "yes"),
    ("kl_metric", 3),
    ("prefix", None),
]
OUT_OF_RANGE = [
    ("max_kl", -0.1),
    ("max_kl", math.nan),
    ("max_nonfinite_fraction", 1.5),
    ("max_nonfinite_fraction", -0.01),
    ("log_every_n_steps", 0),
    ("top_n", -1),
    ("sample_size", 0),
    ("patience", 0),
    ("calibration_steps", -1),
]


@pytest.mark.parametrize(("name", "value"), WRONG_TYPE)
def test_a_wrong_type_is_a_type_error_naming_the_argument(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        KLSampleTrainMonitor(**{name: value})


@pytest.mark.parametrize(("name", "value"), OUT_OF_RANGE)
def test_a_value_out_of_range_is_a_value_error_naming_the_argument(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        KLSampleTrainMonitor(**{name: value})


def test_numbers_of_any_real_type_are_accepted_as_floats() -> None:
    monitor = KLSampleTrainMonitor(max_kl=np.float32(0.5), max_nonfinite_fraction=0, max_histogram_tokens=-1)
    assert monitor.max_kl == 0.5 and type(monitor.max_kl) is float
    assert monitor.guard_rail.max_nonfinite_fraction == 0.0
    assert KLSampleTrainMonitor(max_kl=None).max_kl is None
