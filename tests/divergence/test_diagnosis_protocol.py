"""Both diagnosis benchmarks follow one protocol: healthy steps of the same engine before a fault.

The monitor calibrates its precision bound on a run's first healthy logged steps; a user's run has
them before a fault appears (a template bug excepted: it is there from the first step). A
benchmark that started the monitor on the fault would let the fault's own steps set the bound.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_diagnosis as bench  # noqa: E402
import heldout_faults as hf  # noqa: E402

from loops_callbacks import KLSampleTrainMonitor  # noqa: E402


def fake_steps() -> dict[str, list[dict[str, object]]]:
    """Every held-out fault's steps, each step naming its fault and index (no model needed)."""
    return {fault.name: [{"fault": fault.name, "index": i} for i in range(12)] for fault in hf.FAULTS}


def test_held_out_faults_follow_healthy_steps_of_their_own_engine() -> None:
    data = fake_steps()
    for fault in hf.FAULTS:
        prefix = bench.healthy_prefix(data, fault)
        if fault.cause == "template":
            assert prefix == [], fault.name
            continue
        healthy = hf.FAULTS_BY_NAME[prefix[0]["fault"]]
        assert len(prefix) == bench.HEALTHY_STEPS, fault.name
        assert healthy.cause in ("none", "precision") and healthy.sampler_dtype == fault.sampler_dtype, fault.name
        assert (healthy.temperature, healthy.top_k, healthy.top_p, healthy.offset, healthy.lag) == (1.0, 0, 1.0, 0, 0)
        assert not healthy.trainer_dropout and not healthy.template and not healthy.stale_prefix
        assert [step["index"] for step in prefix] == list(range(bench.HEALTHY_STEPS))


def test_tuning_faults_start_after_the_healthy_steps_except_a_template_change() -> None:
    for name, (_, options) in {**bench.FAULTS, **bench.OTHER_FAULTS}.items():
        started = bench.with_healthy_start(options, 5)
        assert {k: v for k, v in started.items() if k != "faults_from_step"} == options, name  # nothing else changed
        expected = 0 if "sampler_prompt" in options else 5
        assert started.get("faults_from_step", 0) == expected, name
    assert bench.HEALTHY_STEPS == inspect.signature(KLSampleTrainMonitor).parameters["calibration_steps"].default


def test_a_fault_replayed_after_the_healthy_steps_keeps_its_datums_lags() -> None:
    """The replay's trainer is ``len(prefix)`` optimizer steps further on: the versions move with it,
    or every datum of every fault would read as 5 steps stale (and the lag rule could not work)."""
    import torch

    step = {"policy_version": torch.tensor([3, 1]), "truth": "stale"}
    moved = bench.after_steps(step, 5)
    assert moved["policy_version"].tolist() == [8, 6] and moved["truth"] == "stale"
    assert step["policy_version"].tolist() == [3, 1]  # the cached step is not modified
    assert bench.after_steps(step, 0) is step
