"""Each cause's signature, built synthetically: the statistic shows it and the rule names it.

Contexts are random logits over a vocabulary of 14; tokens are drawn from the sampler's
distribution (as an RL sampler draws them), and each cause changes how the sampler's logprobs
relate to the trainer's. One batch of 64 datums x 16 positions (1,024 action tokens) per case.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.diagnosis import diagnose, noise_bound
from loops_callbacks.divergence.diagnosis import Calibration
from loops_callbacks.divergence.statistics import signature_numbers, token_eta2
from loops_callbacks.divergence.statistics import DivergenceStats, HostDivergence
from loops_callbacks.divergence.monitor import GuardRail
from tests.helpers import TinyPolicy, TokenDataset, assert_totals_equal, quiet_trainer, reduce_in_threads
from tests.oracle import PREFIX

B, T, V = 64, 16, 14


def _truncate(logits: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def case(cause: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded tensors of one synthetic batch whose sampler has ``cause``."""
    g = torch.Generator().manual_seed(seed)
    trainer_logits = 2.5 * torch.randn(B, T, V, generator=g)
    sampler_logits = trainer_logits.clone()
    if cause == "precision":
        sampler_logits = (trainer_logits.bfloat16().float() + 1e-3 * torch.randn(B, T, V, generator=g))
    elif cause == "temperature":
        sampler_logits = trainer_logits / 0.7
    elif cause == "truncation":
        sampler_logits = _truncate(trainer_logits, 3)
    elif cause == "unrelated":
        sampler_logits = 2.5 * torch.randn(B, T, V, generator=g)
    elif cause == "stale":  # the trainer has since learned to prefer some tokens over others
        trainer_logits = trainer_logits + 0.8 * torch.randn(V, generator=g)
    sampler_lp = torch.log_softmax(sampler_logits, -1)
    tokens = torch.multinomial(sampler_lp.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    sampler = sampler_lp.gather(-1, tokens[..., None]).squeeze(-1)
    trainer = torch.log_softmax(trainer_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    if cause == "shift":  # position k reports the logprob of position k + 1
        sampler = torch.cat([sampler[:, 1:], sampler[:, -1:]], dim=1)
    return {"sampler_logprobs": sampler, "training_logprobs": trainer, "mask": torch.ones(B, T),
            "target_tokens": tokens}


def host_of(batch: dict[str, torch.Tensor]) -> HostDivergence:
    return DivergenceStats.from_batch(flatten_padded(**batch)).to_host()


def named(batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[Diagnosis, dict[str, float]]:
    host = host_of(batch)
    signatures = signature_numbers(host)
    return diagnose(signatures, n_tokens=host.totals["n_action_tokens"], **kwargs), signatures


def test_no_mismatch_has_d_zero_on_every_token() -> None:
    found, sig = named(case("none"))
    assert sig["frac_d_zero"] == 1.0 and sig["pearson"] == pytest.approx(1.0)
    assert found.cause == "none" and found.confidence == 1.0


def test_shift_is_matched_one_position_over() -> None:
    found, sig = named(case("shift"))
    assert sig["shift_ratio"] < 1e-6 and sig["shift_direction"] == -1.0
    assert found.cause == "shift" and found.confidence == 1.0
    assert "shifted by one position" in found.message and "sampler's at k−1" in found.message


def test_truncation_has_no_positive_diff_and_mass_below_one() -> None:
    found, sig = named(case("truncation"))
    assert sig["frac_d_pos"] == 0.0 and sig["is_ratio_mean"] < 0.95
    assert found.cause == "truncation"


def test_temperature_splits_signs_by_sampler_probability_and_the_slope_estimates_it() -> None:
    found, sig = named(case("temperature"))
    assert sig["sign_split"] == 1.0 and sig["temperature_sign"] == -1.0  # T < 1: d < 0 on likely tokens
    assert 0.6 < sig["temperature"] < 0.85
    assert found.cause == "temperature" and "slope of trainer on sampler logprobs 0." in found.message


def test_unrelated_distributions_are_uncorrelated() -> None:
    found, sig = named(case("unrelated"))
    assert abs(sig["pearson"]) < 0.3
    assert found.cause == "unrelated"


def test_stale_weights_make_token_identity_explain_the_diff() -> None:
    found, sig = named(case("stale"), noise_floor=1e-6)  # a run calibrated on its healthy steps
    assert sig["token_eta2"] > 0.2
    assert found.cause == "stale"
    assert sig["relative_gap"] > 1e-2 and named(case("stale"))[0].cause == "stale"  # above any engine's rounding
    # before the run's noise floor is known, token identity at a gap a bf16 engine can leave is not read:
    # bf16 rounding of the weights leaves it too
    bf16_sized = sig | {"relative_gap": 5e-3, "relative_gap_se": 1e-4}
    assert diagnose(bf16_sized, n_tokens=B * T).cause == "unclear"
    assert diagnose(bf16_sized, n_tokens=B * T, noise_floor=1e-5).cause == "stale"


def test_precision_noise_is_small_and_not_tied_to_token_identity() -> None:
    found, sig = named(case("precision"))
    assert sig["kl_sample_train_k3"] < 1e-4 and sig["token_eta2"] < 0.05
    assert found.cause == "precision"
    # the gap is beyond a floor a fortieth of it (20x that floor is half the gap): not rounding noise then
    assert named(case("precision"), noise_floor=sig["relative_gap"] / 40)[0].cause == "unclear"


def test_too_few_tokens_are_unclear() -> None:
    batch = {k: v[:1, :8] for k, v in case("shift").items()}
    assert named(batch)[0].cause == "unclear"


def test_calibration_learns_the_noise_floor_from_healthy_steps_only() -> None:
    calibration = Calibration(calibration_steps=2)
    calibration.observe(Diagnosis("shift", 1.0), {"relative_gap": 5.0})
    calibration.observe(Diagnosis("precision", 1.0), {"relative_gap": 1e-6})
    assert calibration.noise_floor is None and noise_bound(calibration.noise_floor) == 1e-3  # not calibrated: the prior
    calibration.observe(Diagnosis("precision", 1.0), {"relative_gap": 3e-6})
    assert calibration.noise_floor == pytest.approx(2e-6)
    assert noise_bound(calibration.noise_floor) == pytest.approx(20 * 2e-6)


def test_calibration_takes_a_noise_shaped_step_above_the_prior_but_not_a_growing_or_shaped_one() -> None:
    """A bf16 engine's healthy gap can sit above the prior bound: an unclear step whose numbers are rounding
    noise's calibrates; steps that disagree (a gap growing from step 0), or carry a slope, do not."""
    noise = {"temperature": 1.0005, "sign_split": 0.2, "context_fade": 1.0, "context_fade_z": 0.1}
    calibration = Calibration(calibration_steps=3)
    for gap in (3e-3, 4e-3, 3.5e-3):
        calibration.observe(Diagnosis("unclear", 0.0), noise | {"relative_gap": gap})
    assert calibration.noise_floor == pytest.approx(3.5e-3)
    growing = Calibration(calibration_steps=3)
    for gap in (1e-4, 2e-3, 4e-2):  # the last is past the ceiling, the first two 20x apart
        growing.observe(Diagnosis("unclear", 0.0), noise | {"relative_gap": gap})
    assert growing.noise_floor is None and growing.healthy_gaps == [2e-3]
    sloped = Calibration(calibration_steps=1)
    sloped.observe(Diagnosis("unclear", 0.0), noise | {"relative_gap": 3e-3, "temperature": 1.1})
    assert sloped.noise_floor is None


def test_token_eta2_is_about_zero_when_token_identity_explains_nothing() -> None:
    rng = np.random.default_rng(0)
    ids, d = rng.integers(0, 1024, 5000), rng.standard_normal(5000)
    sums = np.stack([np.bincount(ids, minlength=1024), np.bincount(ids, d, 1024), np.bincount(ids, d * d, 1024)])
    assert abs(token_eta2(sums.astype(float))) < 0.05


@pytest.mark.parametrize("cause", ["shift", "temperature", "stale", "truncation"])
def test_signature_sums_merge_across_micro_batches_and_ranks(cause: str) -> None:
    batch = case(cause, seed=3)
    whole = host_of(batch)
    parts = [DivergenceStats.from_batch(flatten_padded(**{k: v[i::3] for k, v in batch.items()})) for i in range(3)]
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert_totals_equal(merged.to_host(), whole)  # accumulation
    for result in reduce_in_threads(parts):  # 3 ranks
        assert_totals_equal(result.to_host(), whole)
    got = signature_numbers(merged.to_host())
    for name, value in signature_numbers(whole).items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), name


def test_shift_pairs_never_cross_datums() -> None:
    batch = case("none")
    batch["sampler_logprobs"] = batch["sampler_logprobs"].clone()
    batch["mask"][:, 1::2] = 0.0  # no two adjacent action tokens in any datum
    assert host_of(batch).totals["n_pairs"] == 0


class ShiftedSampler(TinyPolicy):
    """Reports the sampler logprob of position k + 1 at position k: an off-by-one in the alignment."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        trainer = out["training_logprobs"].detach()
        out["logprobs"] = torch.cat([trainer[:, 1:], trainer[:, -1:]], dim=1)
        return out

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(), batch_size=16)  # about 100 action tokens a step


def test_the_guard_rail_names_the_likely_cause_and_each_step_logs_it() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, patience=1, on_exceed="stop"), log_every_n_steps=1)
    trainer = quiet_trainer(max_steps=5, callbacks=[monitor])
    with pytest.warns(UserWarning, match="likely cause: sampler logprobs are shifted by one position"):
        trainer.fit(ShiftedSampler())
    assert trainer.global_step == 1
    assert "likely cause: sampler logprobs are shifted by one position (shift ratio" in monitor.stop_reason
    assert "check the alignment of logprobs with target tokens" in monitor.stop_reason
    assert monitor.last_diagnosis is not None and monitor.last_diagnosis.cause == "shift"
    assert trainer.callback_metrics[PREFIX + "diagnosis/shift"] == 1.0
    assert trainer.callback_metrics[PREFIX + "diagnosis/stale"] == 0.0
    assert trainer.callback_metrics[PREFIX + "signature/shift_ratio"] < 0.1


def test_probabilities_mimic_truncation_so_impossible_inputs_are_named_first() -> None:
    from loops_callbacks.divergence.diagnosis import IMPOSSIBLE_INPUTS, diagnosis_metrics
    from loops_callbacks.divergence.guard_rail import impossible_inputs

    batch = case("none")
    batch["sampler_logprobs"] = batch["sampler_logprobs"].exp()  # probabilities passed as logprobs
    host = host_of(batch)
    assert named(batch)[0].cause == "truncation"  # what the statistical rule alone would say
    problems = impossible_inputs(host)
    assert list(problems) == ["sampler_above_zero"]
    found = Diagnosis.impossible_inputs(problems.values())
    assert found.cause == IMPOSSIBLE_INPUTS and found.confidence == 1.0
    assert found.message.startswith("likely cause: the inputs are not valid logprobs: ")
    assert "these look like probabilities, not logprobs" in found.message and "truncat" not in found.message
    metrics = diagnosis_metrics(found, signature_numbers(host), prefix="div/")
    assert metrics["div/diagnosis/impossible_inputs"] == 1.0 and metrics["div/diagnosis/truncation"] == 0.0


def test_a_signature_that_is_a_scalar_metric_is_logged_once_under_the_scalar_key() -> None:
    """mean e^d and k3 are scalar metrics; the diagnosis reads them but does not log them again."""
    from loops_callbacks.divergence.diagnosis import diagnosis_metrics
    from loops_callbacks.divergence.statistics import scalar_metrics

    host = host_of(case("stale"))
    signatures = signature_numbers(host)
    scalars = scalar_metrics(host, prefix=PREFIX)
    logged = diagnosis_metrics(diagnose(signatures, n_tokens=host.totals["n_action_tokens"]), signatures, prefix=PREFIX)
    repeated = {
        key: name for key, value in logged.items() if "/signature/" in key
        for name, scalar in scalars.items() if value == scalar and not float(value).is_integer()
    }
    assert repeated == {}
    assert signatures["is_ratio_mean"] == scalars[PREFIX + "is_ratio_mean"]
    assert signatures["kl_sample_train_k3"] == scalars[PREFIX + "kl_sample_train_k3"]
