"""The monitor's checkpoint state: what it saves loads back; a damaged one is a ValueError naming the field, and
one written by a newer version (a field this one does not know) loads with a warning naming what is ignored."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.monitor import GuardRail


def saved() -> dict[str, Any]:
    """The state of a monitor that saw two steps, the second diagnosed, the way ``state_dict`` gives it."""
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05))
    monitor.history.observe(0, {"n_action_tokens": 0.0}, None)
    beyond = Diagnosis("stale", 0.7, {"lag_growth": 2.0})
    monitor.history.observe(1, {"n_action_tokens": 64.0, "kl_sample_train_k3": 0.01},
                            Diagnosis("dropout", 1.0, {"dropout_p": 0.1}, observed="2 Dropout modules", beyond=beyond))
    monitor.calibration.observe(Diagnosis("precision", 0.9), {"relative_gap": 1e-5})
    monitor.guard_rail.exceeded_steps = 1
    return monitor.state_dict()


def loaded(state: dict[str, Any]) -> KLSampleTrainMonitor:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05))
    monitor.load_state_dict(state)
    return monitor


def test_what_is_saved_loads_back() -> None:
    state = saved()
    monitor = loaded(copy.deepcopy(state))
    assert monitor.state_dict() == state
    assert monitor.history.last_diagnosis.beyond.cause == "stale"


@pytest.mark.parametrize(("path", "value", "named"), [
    (("calibration",), None, "'calibration'"),
    (("calibration", "healthy_gaps"), None, "'calibration.healthy_gaps'"),
    (("calibration", "recent_gaps"), ["a"], r"'calibration.recent_gaps\[0\]'"),
    (("history",), [], "'history'"),
    (("history", "logged_steps"), "2", "'history.logged_steps'"),
    (("history", "last_step"), -1, "'history.last_step'"),
    (("history", "causes"), {"none": [1]}, "'history.causes.none'"),
    (("history", "metrics_with_action_tokens"), None, "'history.metrics_with_action_tokens'"),
    (("history", "last_diagnosis"), "dropout", "'history.last_diagnosis'"),
    (("history", "last_diagnosis", "confidence"), None, "'history.last_diagnosis.confidence'"),
    (("history", "last_diagnosis", "beyond", "numbers"), [1.0], "'history.last_diagnosis.beyond.numbers'"),
    (("exceeded_steps",), None, "'exceeded_steps'"),
    (("exceeded_steps",), -1, "'exceeded_steps'"),
])
def test_a_damaged_state_is_a_value_error_naming_the_field(path: tuple[str, ...], value: Any, named: str) -> None:
    state = saved()
    place = state
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05))
    before = monitor.state_dict()
    with pytest.raises(ValueError, match=rf"KLSampleTrainMonitor\.load_state_dict: {named} "):
        monitor.load_state_dict(state)
    assert monitor.state_dict() == before  # nothing of a damaged state is kept


def test_a_state_that_is_not_a_mapping_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="load_state_dict: the state must be a mapping"):
        KLSampleTrainMonitor().load_state_dict(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", [(), ("calibration",), ("history",), ("history", "last_diagnosis"),
                                  ("history", "last_diagnosis", "beyond")])
def test_a_field_of_a_newer_version_is_a_warning_and_ignored(path: tuple[str, ...]) -> None:
    state = saved()
    place = state
    for key in path:
        place = place[key]
    place["new"] = 1
    with pytest.warns(UserWarning, match=r"load_state_dict: .*'new'.* not known to this version.*ignored"):
        monitor = loaded(state)
    del place["new"]
    assert monitor.state_dict() == state


def test_an_older_state_without_some_fields_still_loads_without_a_word() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor = loaded({"exceeded_steps": 2, "stop_reason": "an older version saved it",
                          "history": {"last_diagnosis": {"cause": "none", "confidence": 1.0, "evidence": {}}}})
    assert monitor.guard_rail.exceeded_steps == 2 and monitor.history.last_diagnosis.cause == "none"


def test_causes_in_an_older_checkpoints_form_are_read_as_counts() -> None:
    monitor = loaded({"history": {"logged_steps": 3, "causes": {"stale": {"steps": 3, "first_step": 4}}}})
    assert monitor.history.causes == {"stale": [3, 4]}
    assert "stale 3 (first at step 4)" in "\n".join(monitor.summary_lines())
