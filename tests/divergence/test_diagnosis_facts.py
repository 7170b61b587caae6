"""What the run states of itself is named first, as observed: the policy lag its versions give, the settings an
engine applied to the logprobs it reports; and a gap that grows step after step is never rounding noise."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from loops_callbacks.divergence.diagnosis import NOISE_PRIOR, diagnose
from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.divergence.diagnosis import Calibration
from loops_callbacks.divergence.statistics import signature_numbers
from tests.divergence.test_diagnosis import host_of
from tests.divergence.test_diagnosis_rules import flat_temperature

QUIET = {"frac_d_zero": 0.0, "relative_gap": 1e-4, "relative_gap_se": 1e-6, "temperature": 1.0, "temperature_se": 1e-3,
         "pearson": 0.999, "frac_d_pos": 0.5, "is_ratio_mean": 1.0, "is_ratio_se": 1e-3, "kl_sample_train_k3": 1e-4,
         "token_eta2": 0.0, "sign_split": 0.5}
"""A step whose gap is rounding noise's."""


def test_the_lag_the_versions_state_is_stale_observed_whatever_the_gap() -> None:
    quiet = diagnose(QUIET | {"lag_min": 3.0, "lag_max": 5.0}, n_tokens=1000)
    assert quiet.cause == "stale" and quiet.is_observation and quiet.numbers["lag_max"] == 5.0
    assert "sampled with weights 3 to 5 optimizer steps behind the trainer's" in quiet.message
    assert "within rounding noise so far" in quiet.message
    one = diagnose(QUIET | {"lag_min": 1.0, "lag_max": 1.0, "relative_gap": 0.3}, n_tokens=1000)
    assert "every datum sampled with weights 1 optimizer step behind" in one.message and "beyond rounding" in one.message
    # too few tokens to weigh anything: the versions still say it
    assert diagnose(QUIET | {"lag_min": 0.0, "lag_max": 2.0}, n_tokens=10).cause == "stale"


def test_the_intended_lag_is_no_fault_and_no_versions_say_nothing() -> None:
    assert diagnose(QUIET | {"lag_min": 1.0, "lag_max": 1.0}, n_tokens=1000, max_policy_lag=1).cause == "precision"
    assert diagnose(QUIET | {"lag_min": 0.0, "lag_max": 0.0}, n_tokens=1000).cause == "precision"
    assert diagnose(QUIET | {"lag_min": math.nan, "lag_max": math.nan}, n_tokens=1000).cause == "precision"
    assert diagnose(QUIET | {"lag_min": 1.0, "lag_max": 2.0}, n_tokens=1000, max_policy_lag=1).message.count(
        "some datums sampled with weights 1 to 2 optimizer steps behind") == 1


def test_an_engine_reporting_processed_logprobs_at_a_temperature_is_named_from_its_settings() -> None:
    host = host_of(flat_temperature(0.8))
    sig = signature_numbers(host)
    facts = SamplerFacts(engine="vllm", dtype="float32", logprobs_mode="processed_logprobs", temperature=0.8)
    found = diagnose(sig, n_tokens=host.totals["n_action_tokens"], facts=facts)
    assert found.cause == "temperature" and found.is_observation and found.confidence == 1.0
    assert "reports processed_logprobs, after temperature 0.8" in found.message
    assert "divide the trainer's logits by 0.8" in found.message
    # settings the gap does not agree with are not named from them: a trainer at the same temperature leaves none
    same = diagnose(QUIET | {"relative_gap": 1e-10, "relative_gap_se": 1e-12}, n_tokens=1000, facts=facts)
    assert same.cause == "precision" and not same.is_observation
    hotter = SamplerFacts(engine="vllm", logprobs_mode="processed_logprobs", temperature=1.3)
    assert not diagnose(sig, n_tokens=host.totals["n_action_tokens"], facts=hotter).is_observation


def test_a_gap_that_grows_step_after_step_under_the_bound_is_not_noise() -> None:
    """A failed sync whose versions still count: the gap grows 30x over 15 steps while the bound follows it."""
    gaps = [4e-5 * 1.27**step for step in range(15)]  # 4e-5 to 1.1e-3: within the prior bound of 1e-3 for 14 steps
    causes = []
    for step, gap in enumerate(gaps):
        sig = QUIET | {"relative_gap": gap, "lag_min": 0.0, "lag_max": 0.0}
        causes.append(diagnose(sig, n_tokens=1000, trend=gaps[:step]).cause)
    # ten steps of steady growth (rho sqrt(n - 1) = 3), the last beyond the prior bound too
    assert causes[:9] == ["precision"] * 9 and set(causes[9:]) == {"stale"}, causes
    # noise stays level: a healthy run's gaps, however they scatter, never read as growing
    level = torch.Generator().manual_seed(0)
    noisy = (1e-4 * torch.exp(0.6 * torch.randn(256, generator=level))).tolist()
    assert {diagnose(QUIET | {"relative_gap": g}, n_tokens=1000, trend=noisy[:i][-32:]).cause
            for i, g in enumerate(noisy)} == {"precision"}
    assert max(noisy) < NOISE_PRIOR


def test_the_floor_never_learns_a_gap_far_above_it() -> None:
    calibration = Calibration(calibration_steps=3)
    for gap in (1e-5, 1.2e-5, 0.9e-5):
        calibration.observe(diagnose(QUIET | {"relative_gap": gap}, n_tokens=1000), {"relative_gap": gap})
    floor = calibration.noise_floor
    for gap in (5e-5, 1e-4, 1.5e-4, 1.9e-4) * 8:  # each within the bound (20x the floor) but far above the floor
        calibration.observe(diagnose(QUIET | {"relative_gap": gap}, n_tokens=1000, noise_floor=floor), {"relative_gap": gap})
    assert calibration.noise_floor == floor


def test_a_float32_engine_s_floor_is_never_learned_from_unclear_steps() -> None:
    """A failed sync on SmolLM2 with a float32 sampler: step 0 at 2.7e-12, then gaps of 1e-4 to 1e-2 no rule named;
    five such `unclear` steps calibrated a floor of 1.2e-3 (bound 0.024) and the fault read `precision` from then."""
    facts = SamplerFacts(engine="hf", dtype="float32", logprobs_mode="raw_logprobs")
    calibration = Calibration(calibration_steps=5)
    for gap in (2.7e-12, 6e-5, 3.5e-4, 2.7e-4, 6.6e-4, 1.3e-3, 1.2e-3, 1.2e-3, 1.6e-3):
        sig = QUIET | {"relative_gap": gap, "token_eta2": 0.8, "lag_min": 0.0, "lag_max": 0.0}
        found = diagnose(sig, n_tokens=1000, facts=facts, noise_floor=calibration.noise_floor,
                         trend=calibration.recent_gaps, by_lag={"0": SimpleNamespace(n_tokens=1000, abs_d_mean=0.01)})
        calibration.observe(found, sig)
    assert calibration.noise_floor is None and found.cause != "precision"
