"""The rules that keep the diagnosis from being confidently wrong: temperature read from the slope
(flat distributions, T < 1 against truncation), staleness from per-lag numbers and from the run's trend."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.diagnosis import diagnose
from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.divergence.diagnosis import Calibration
from loops_callbacks.divergence.statistics import signature_numbers
from loops_callbacks.divergence.statistics import DivergenceStats
from tests.divergence.test_diagnosis import case, host_of


def flat_temperature(temperature: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat-ish LM over 1,000 tokens (some tokens frequent everywhere), sampled at ``temperature``,
    the sampler reporting the processed logprobs (as HF's compute_transition_scores(normalize_logits=True))."""
    g = torch.Generator().manual_seed(seed)
    rows, width, vocab = 128, 16, 1000
    logits = 0.5 * torch.randn(rows, width, vocab, generator=g) + 1.5 * torch.randn(vocab, generator=g)
    processed = torch.log_softmax(logits / temperature, -1)
    tokens = torch.multinomial(processed.exp().reshape(-1, vocab), 1, generator=g).reshape(rows, width)
    return {
        "sampler_logprobs": processed.gather(-1, tokens[..., None]).squeeze(-1),
        "training_logprobs": torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1),
        "mask": torch.ones(rows, width),
        "target_tokens": tokens,
    }


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_a_one_sided_temperature_on_flat_distributions_is_temperature_not_stale(temperature: float) -> None:
    host = host_of(flat_temperature(temperature))
    sig = signature_numbers(host)
    assert math.isnan(sig["sign_split"]) and sig["token_eta2"] > 0.5  # no token with p > 0.5; token id explains d
    found = diagnose(sig, n_tokens=host.totals["n_action_tokens"])
    assert found.cause == "temperature" and abs(sig["temperature"] - temperature) < 0.03
    assert f"slope of trainer on sampler logprobs {temperature:.2f}" in found.message


def test_temperature_below_one_is_not_truncation_the_slope_separates_them() -> None:
    """Few d > 0 and mean e^d below 1 fit both; truncation keeps the slope of t on s at 1 or more, T < 1 has slope T."""
    sig = {"frac_d_zero": 0.0, "pearson": 0.99, "frac_d_pos": 0.01, "is_ratio_mean": 0.9, "is_ratio_se": 0.01,
           "sign_split": float("nan"), "kl_sample_train_k3": 0.05, "token_eta2": 0.0}
    assert diagnose(sig | {"temperature": 0.8}, n_tokens=1000).cause == "temperature"
    assert diagnose(sig | {"temperature": 1.02}, n_tokens=1000).cause == "truncation"
    truncated = signature_numbers(host_of(case("truncation")))
    assert truncated["temperature"] >= 0.95 and diagnose(truncated, n_tokens=1024).cause == "truncation"


@dataclass(frozen=True)
class Lag:
    n_tokens: float
    abs_d_mean: float


def test_a_gap_that_grows_with_the_policy_lag_is_stale_with_the_per_lag_numbers() -> None:
    sig = signature_numbers(host_of(case("unrelated")))  # what weights far out of date look like
    by_lag = {
        "0": Lag(400, 0.02), "1": Lag(300, 0.3), "2": Lag(200, 0.7), "3": Lag(0, float("nan")), "4-7": Lag(90, 1.4)
    }
    found = diagnose(sig, n_tokens=1024, by_lag=by_lag)
    assert found.cause == "stale" and found.numbers["lag_growth"] == pytest.approx(70.0)
    assert "abs d lag 0 0.02" in found.message and "abs d lag 4-7 1.4" in found.message
    assert "abs_d_lag_3" not in found.numbers  # no tokens there


def test_versions_that_show_no_growth_with_the_lag_rule_stale_out() -> None:
    host = host_of(case("stale"))
    sig = signature_numbers(host)
    assert diagnose(sig, n_tokens=1024, noise_floor=1e-6).cause == "stale"  # token identity alone says stale
    flat = {"0": Lag(500, 0.3), "1": Lag(500, 0.31), "2": Lag(24, 5.0)}  # lag 2: too few tokens to count
    found = diagnose(sig, n_tokens=1024, by_lag=flat, noise_floor=1e-6)
    assert found.cause == "unclear" and found.numbers["lag_growth"] == pytest.approx(0.31 / 0.3)


def test_a_gap_that_grows_step_after_step_since_the_last_sync_is_stale() -> None:
    sig = signature_numbers(host_of(case("stale"))) | {"token_eta2": 0.0}  # token identity says nothing here
    gap = sig["relative_gap"]
    assert diagnose(sig, n_tokens=1024).cause == "unclear"
    growing = (1e-6, 0.1 * gap, 0.3 * gap, 0.6 * gap)  # in sync, then further apart each step
    found = diagnose(sig, n_tokens=1024, trend=growing)
    assert found.cause == "stale" and found.numbers["steps_growing"] == 4.0
    assert "gap growth" in found.message
    assert diagnose(sig, n_tokens=1024, trend=(1e-6, gap, 0.9 * gap, 1.1 * gap)).cause == "unclear"  # a jump
    assert diagnose(sig, n_tokens=1024, trend=(0.1 * gap, 0.3 * gap, 0.6 * gap)).cause == "unclear"  # never in sync


def test_a_truncating_sampler_whose_gap_grows_as_the_policy_sharpens_is_truncation_not_stale() -> None:
    """Top-p late in a run (``configs/rl_faults.yaml``, ``sampler_top_p=0.9``, steps 144 and 149): the
    renormalized logprobs keep d of one sign while the relative gap grows as the policy sharpens. The
    trend alone would say stale; stale weights move d both ways."""
    sig = signature_numbers(host_of(case("truncation")))
    gap = sig["relative_gap"]
    growing = (1e-6, 0.1 * gap, 0.3 * gap, 0.6 * gap)
    assert diagnose(sig, n_tokens=1024, trend=growing).cause == "truncation"
    both_ways = sig | {"frac_d_pos": 0.4, "token_eta2": 0.0}  # the same numbers with d of both signs
    assert diagnose(both_ways, n_tokens=1024, trend=growing).cause == "stale"


def test_versions_outrank_the_history_a_growing_gap_at_lag_zero_is_not_stale() -> None:
    """With per-datum versions the lag is known: a gap that grows while every datum is current
    (a sharpening policy, MoE routing drift) is not staleness, whatever the trend says."""
    sig = signature_numbers(host_of(case("stale"))) | {"token_eta2": 0.0}
    gap = sig["relative_gap"]
    growing = (1e-6, 0.1 * gap, 0.3 * gap, 0.6 * gap)
    assert diagnose(sig, n_tokens=1024, trend=growing).cause == "stale"  # without versions: the history decides
    current = {"0": Lag(1024, 0.3)}
    assert diagnose(sig, n_tokens=1024, trend=growing, by_lag=current).cause != "stale"
    no_growth = {"0": Lag(500, 0.3), "1": Lag(500, 0.31)}
    assert diagnose(sig, n_tokens=1024, trend=growing, by_lag=no_growth).cause != "stale"
    all_behind = {"0": Lag(0, float("nan")), "2": Lag(1024, 0.3)}  # every datum 2 steps behind
    found = diagnose(sig, n_tokens=1024, by_lag=all_behind)  # no history needed: the versions say it
    assert found.cause == "stale" and found.numbers["lag"] == 2.0


def test_every_datum_behind_is_stale_from_the_first_lagged_step_when_the_gap_is_beyond_noise() -> None:
    """Versions that show every datum one step behind name staleness at once; at a gap within the run's
    rounding noise they do not (an asynchronous run one step behind by design, at the floor)."""
    sig = signature_numbers(host_of(case("stale"))) | {"token_eta2": 0.0}
    one_behind = {"0": Lag(0, float("nan")), "1": Lag(1024, 0.3)}
    found = diagnose(sig, n_tokens=1024, by_lag=one_behind)
    assert found.cause == "stale" and "lag 1" in found.message
    assert diagnose(sig, n_tokens=1024, by_lag=one_behind, noise_floor=sig["relative_gap"]).cause == "precision"


def test_calibration_keeps_the_recent_relative_gaps_for_the_trend() -> None:
    calibration = Calibration(calibration_steps=1)
    for gap in (0.0, 0.01, float("nan"), 0.02):
        calibration.observe(Diagnosis("stale", 0.6), {"relative_gap": gap})
    assert calibration.recent_gaps == [0.0, 0.01, 0.02]


def test_the_report_reads_the_per_lag_numbers_of_the_host() -> None:
    """step_report diagnoses with host.by_lag: none without policy versions, the lag strata with them."""
    from loops_callbacks.divergence.guard_rail import GuardRail
    from loops_callbacks.divergence.report import step_report
    from loops_callbacks.divergence.statistics import LAG_STRATA
    from loops_callbacks.divergence.statistics import StratumSums

    batch = case("unrelated")
    host = DivergenceStats.from_batch(flatten_padded(**batch)).to_host()
    rail = GuardRail(None, "kl_sample_train_k3")
    lags = dict.fromkeys(LAG_STRATA, StratumSums(0.0, 0.0, 0.0, 0.0))
    lagged = dataclasses.replace(host, strata=lags | {"lag_0": StratumSums(400, 0, 400 * 0.02, 400),
                                                      "lag_1": StratumSums(300, 0, 300 * 0.3, 300)})
    assert step_report(host, guard_rail=rail).diagnosis.cause == "unrelated"
    assert step_report(lagged, guard_rail=rail).diagnosis.cause == "stale"


def test_token_identity_at_the_level_of_rounding_noise_is_not_staleness() -> None:
    """A gap above the precision bound that token identity explains only as much as bf16 rounding noise
    can (eta2 up to about 0.1 on the tuning generator) is unclear, not stale; a clear share still is."""
    sig = {"frac_d_zero": 0.0, "pearson": 0.999, "temperature": 1.0, "frac_d_pos": 0.5, "is_ratio_mean": 1.0,
           "is_ratio_se": 0.001, "sign_split": 0.5, "shift_ratio": 50.0, "kl_sample_train_k3": 2e-3,
           "relative_gap": 2e-3, "relative_gap_se": 1e-5}
    weak = diagnose(sig | {"token_eta2": 0.08}, n_tokens=1000, noise_floor=1e-5)
    assert weak.cause == "unclear" and weak.numbers["token_eta2"] == 0.08
    assert diagnose(sig | {"token_eta2": 0.25}, n_tokens=1000, noise_floor=1e-5).cause == "stale"
    # at the level of the run's own noise, token identity is not read at all
    assert diagnose(sig | {"token_eta2": 0.25}, n_tokens=1000, noise_floor=1e-4).cause == "precision"


def test_exact_matches_on_most_tokens_are_no_mismatch_only_when_the_rest_is_within_noise() -> None:
    """A collapsed policy gives both sides logprob 0 on most tokens: the gap on the rest still counts."""
    sig = {"frac_d_zero": 0.9, "relative_gap": 80.0, "relative_gap_se": 5.0, "pearson": 0.5, "temperature": 1.0,
           "kl_sample_train_k3": 0.5}
    assert diagnose(sig, n_tokens=1000).cause != "none"
    assert diagnose(sig | {"relative_gap": 1e-6}, n_tokens=1000).cause == "none"


def test_every_datum_behind_at_a_gap_a_bf16_floor_would_hide_is_stale_once_calibrated() -> None:
    """A bf16 engine one step behind: the gap is 5x the run's floor, within the 20x that rounding may vary,
    but the versions say every datum is behind: stale. Current datums at that gap stay precision."""
    sig = {"frac_d_zero": 0.0, "relative_gap": 1e-3, "relative_gap_se": 3e-5, "pearson": 0.999, "temperature": 1.0,
           "kl_sample_train_k3": 1.5e-3}
    one_behind = {"0": Lag(0, float("nan")), "1": Lag(4096, 0.02)}
    found = diagnose(sig, n_tokens=4096, by_lag=one_behind, noise_floor=2e-4)
    assert found.cause == "stale" and "lag 1" in found.message
    assert diagnose(sig, n_tokens=4096, by_lag={"0": Lag(4096, 0.02)}, noise_floor=2e-4).cause == "precision"
    assert diagnose(sig, n_tokens=4096, by_lag=one_behind).cause == "precision"  # no floor yet: the prior decides


def test_with_every_datum_current_a_slope_clearly_off_one_is_a_temperature_below_the_usual_margin() -> None:
    """The 0.15 margin keeps weights a few steps old from reading as a temperature; versions that show every
    datum current rule that out, so a slope 0.9 +- 0.004 is a temperature there (processed logprobs at T 0.7
    with top-p and top-k on a real vLLM engine)."""
    sig = {"frac_d_zero": 0.0, "relative_gap": 0.13, "relative_gap_se": 0.005, "pearson": 0.97, "temperature": 0.9,
           "temperature_se": 0.004, "frac_d_pos": 0.09, "is_ratio_mean": 0.83, "is_ratio_se": 0.01,
           "sign_split": 0.8, "temperature_sign": -1.0, "token_eta2": 0.2, "kl_sample_train_k3": 0.04}
    current = {"0": Lag(4096, 0.3)}
    assert diagnose(sig, n_tokens=4096, by_lag=current, noise_floor=1e-9).cause == "temperature"
    assert diagnose(sig, n_tokens=4096, noise_floor=1e-9).cause != "temperature"  # no versions: the margin holds


def padded_step(diff: float, dtype: torch.dtype = torch.float32, tokens: int = 48) -> dict[str, torch.Tensor]:
    """One datum of ``tokens`` action tokens whose trainer logprobs are the sampler's plus ``diff``."""
    sampler = torch.linspace(-3.0, -0.1, tokens).to(dtype)[None]
    return {"sampler_logprobs": sampler, "training_logprobs": (sampler.double() + diff).to(dtype),
            "mask": torch.ones(1, tokens)}


def test_fewer_tokens_than_the_rules_need_are_none_when_every_logprob_is_equal_and_else_say_they_are_too_few() -> None:
    """A healthy loop whose batch is mostly zero advantages: an exact match is seen on any number of tokens, a gap
    on 48 is not weighed, and the message says why."""
    for step, cause in ((padded_step(0.0), "none"), (padded_step(0.05), "unclear"),
                        (padded_step(0.0, torch.bfloat16), "unclear")):  # 16-bit on both sides: equal says less
        host = host_of(step)
        found = diagnose(signature_numbers(host), n_tokens=host.totals["n_action_tokens"])
        assert host.totals["n_action_tokens"] == 48 and found.cause == cause, (cause, found.message)
        if cause == "unclear":
            assert found.message.startswith("likely cause: unclear: too few action tokens on this step to judge "
                                            "(n action tokens 48)"), found.message
    # what the engine says of itself is seen on any number of tokens too: raw logprobs while sampling at 0.7
    host = host_of(padded_step(0.0))
    facts = SamplerFacts(engine="vllm", dtype="float32", logprobs_mode="raw_logprobs", temperature=0.7)
    found = diagnose(signature_numbers(host), n_tokens=48, facts=facts)
    assert found.cause == "sampling" and found.observed, found.message


def test_sampler_logprobs_all_zero_are_named_as_such_not_only_as_truncation() -> None:
    """A sampler whose logprobs were never filled in (a zeros_like) reads as truncation to p = 1, as a greedy sampler's
    processed logprobs do: the message says every one is 0.0, so either is found at once."""
    trainer = torch.linspace(-3.0, -0.1, 256)[None]
    host = host_of({"sampler_logprobs": torch.zeros_like(trainer), "training_logprobs": trainer,
                    "mask": torch.ones_like(trainer)})
    found = diagnose(signature_numbers(host), n_tokens=host.totals["n_action_tokens"])
    assert found.cause == "truncation" and "every sampler logprob is exactly 0.0" in found.message, found.message
    top_k = diagnose(signature_numbers(host_of(case("truncation"))), n_tokens=1024)
    assert top_k.cause == "truncation" and "exactly 0.0" not in top_k.message, top_k.message
