"""The check of what was sampled: Σ(t + H) / √ΣV is about standard normal when the tokens were drawn from the
trainer's distribution, and far from it when they were drawn at another temperature or truncated, while the
reported logprobs (raw, temperature 1) agree with the trainer's exactly."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from loops_callbacks import KLSampleTrainMonitor, token_logprobs
from loops_callbacks.divergence.diagnosis import Diagnosis
from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.diagnosis import diagnose
from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.divergence.guard_rail import GuardRail
from loops_callbacks.divergence.statistics import sampling_metrics, scalar_metrics
from loops_callbacks.divergence.statistics import DivergenceStats
from loops_callbacks.divergence.monitor import MediaOptions
from tests.helpers import TinyPolicy, assert_totals_equal, quiet_trainer, reduce_in_threads
from tests.oracle import PREFIX

B, T, V = 128, 64, 50  # a step of 128 sequences x 64 tokens


def drawn(temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch whose tokens are drawn from the logits at ``temperature`` (and top-p), reported as raw logprobs."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, T, V, generator=g)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(B, T)
    trainer = token_logprobs(logits, tokens, with_entropy=True)
    return {
        "sampler_logprobs": trainer.logprobs.clone(),  # raw logprobs: the trainer's own, whatever was sampled
        "training_logprobs": trainer.logprobs,
        "training_entropy": trainer.entropy,
        "training_varentropy": trainer.varentropy,
        "mask": torch.ones(B, T),
    }


def check(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    host = DivergenceStats.from_batch(flatten_padded(**batch)).to_host()
    return sampling_metrics(host.totals, host.extrema)


def test_honest_draws_give_a_standard_normal_z() -> None:
    zs = [check(drawn(seed=seed))["sampling_z"] for seed in range(40)]
    mean, sd = sum(zs) / len(zs), math.sqrt(sum(z * z for z in zs) / len(zs))
    assert abs(mean) < 0.6 and 0.6 < sd < 1.5 and max(map(abs, zs)) < 4.0
    assert check(drawn(seed=1))["sampling_temperature"] == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize(("temperature", "top_p", "sign"), [(0.7, 1.0, 1), (0.9, 1.0, 1), (1.2, 1.0, -1), (1.0, 0.9, 1)])
def test_draws_at_another_temperature_or_truncated_are_far_from_normal(temperature: float, top_p: float, sign: int) -> None:
    found = check(drawn(temperature, top_p))
    assert sign * found["sampling_z"] > 8, found
    assert sign * found["sampling_relative_bias"] > 0
    if top_p == 1.0:  # the first-order estimate lands near the temperature drawn at
        assert found["sampling_temperature"] == pytest.approx(temperature, abs=0.12)


def test_padding_non_finite_logprobs_and_zero_advantages_are_handled() -> None:
    """Masked positions and a trainer logprob of -inf (a token the trainer cannot draw) are left out; a token
    with advantage 0 counts (the check reads every masked-in token: a selection by reward would bias it)."""
    batch = drawn(seed=3)
    whole = DivergenceStats.from_batch(flatten_padded(**batch)).to_host().totals
    mask = torch.ones(B, T)
    mask[:, -4:] = 0.0
    trainer = batch["training_logprobs"].clone()
    trainer[0, 0] = float("-inf")
    advantages = torch.ones(B)
    advantages[1] = 0.0
    some = DivergenceStats.from_batch(flatten_padded(**(batch | {"mask": mask, "training_logprobs": trainer}),
                                                     advantages=advantages)).to_host().totals
    assert whole["n_sampling_tokens"] == B * T and some["n_sampling_tokens"] == B * (T - 4) - 1
    assert some["n_action_tokens"] == (B - 1) * (T - 4) - 1


def test_the_sums_merge_across_micro_batches_and_ranks() -> None:
    batch = drawn(0.8, seed=4)
    whole = DivergenceStats.from_batch(flatten_padded(**batch))
    parts = [DivergenceStats.from_batch(flatten_padded(**{k: v[i::2] for k, v in batch.items()})) for i in range(2)]
    assert_totals_equal(parts[0].merge(parts[1]).to_host(), whole.to_host())
    for reduced in reduce_in_threads(parts):
        host = reduced.to_host()
        for name in ("sampling_z", "sampling_z_trimmed"):
            assert check(batch)[name] == pytest.approx(sampling_metrics(host.totals, host.extrema)[name])


def one_unlikely_draw() -> dict[str, torch.Tensor]:
    """A collapsed policy (p of its mode 1 - 1e-6 at every position: 128 one-token completions) whose honest
    draw picked a token of p ~ 1e-3 once: a heavy tail allows it, and alone it moves sampling_z to about -9."""
    logits = torch.zeros(128, 1, V)
    logits[..., 0] = 17.0  # the mode: every other token e^-17 / (1 + 49 e^-17)
    logits[7, 0, 1] = 10.0  # at one position a token of p ~ 1e-3, which was drawn
    tokens = torch.zeros(128, 1, dtype=torch.long)
    tokens[7, 0] = 1
    trainer = token_logprobs(logits, tokens, with_entropy=True)
    return {"sampler_logprobs": trainer.logprobs.clone(), "training_logprobs": trainer.logprobs,
            "training_entropy": trainer.entropy, "training_varentropy": trainer.varentropy, "mask": torch.ones(128, 1)}


def test_one_unlikely_token_of_a_collapsed_policy_is_no_sampling_fault() -> None:
    host = DivergenceStats.from_batch(flatten_padded(**one_unlikely_draw())).to_host()
    found = sampling_metrics(host.totals, host.extrema)
    assert found["sampling_z"] < -5 and abs(found["sampling_z_trimmed"]) < 1, found
    sig = {"frac_d_zero": 1.0, "relative_gap": 0.0, "relative_gap_se": 0.0, **found}
    assert diagnose(sig, n_tokens=128).cause == "none"
    scalars = scalar_metrics(host, prefix="")
    rail = GuardRail(max_kl=None, kl_metric="kl_sample_train_k3", max_sampling_z=5.0)
    assert rail.exceeds(scalars, host) is None  # nor does it stop the run
    shifted = check(drawn(1.2))  # the whole distribution drawn flatter: leaving one token out changes little
    assert shifted["sampling_z_trimmed"] < -8 and shifted["sampling_z_trimmed"] > shifted["sampling_z"]


def test_a_sampling_anomaly_beside_a_stale_prefix_cache_is_the_cache() -> None:
    """KV computed with older weights draws from another distribution: the engine's account explains it."""
    sig = {"frac_d_zero": 0.96, "relative_gap": 1e-6, "relative_gap_se": 1e-8, "sampling_z": -18.0,
           "sampling_z_trimmed": -17.0}
    assert diagnose(sig, n_tokens=1000).cause == "sampling"
    found = diagnose(sig, n_tokens=1000, facts=SamplerFacts(engine="vllm", stale_prefix_cache=True))
    assert found.cause == "prefix_cache" and found.is_observation and "sampling z -18" in found.message


def test_without_entropies_nothing_is_logged_and_one_of_the_two_alone_is_an_error() -> None:
    batch = drawn(seed=5)
    plain = {k: v for k, v in batch.items() if not k.startswith("training_") or k == "training_logprobs"}
    assert check(plain) == {}
    with pytest.raises(ValueError, match="'training_entropy' is given without 'training_varentropy'"):
        flatten_padded(**{k: v for k, v in batch.items() if k != "training_varentropy"})


class DrawingPolicy(pl.LightningModule):
    """A policy whose sampler draws its tokens at ``temperature`` and reports the raw (temperature-1) logprobs,
    as vLLM's default logprobs_mode does: the reported logprobs equal the trainer's."""

    def __init__(self, temperature: float, facts: SamplerFacts | None = None) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, V)
        self.temperature, self.facts = temperature, facts

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(6, 128, 24, 8, generator=torch.Generator().manual_seed(0)), batch_size=None)

    def training_step(self, features: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        logits = 3.0 * self.head(features)
        with torch.no_grad():
            probs = torch.softmax(logits / self.temperature, -1)
            tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=torch.Generator().manual_seed(batch_idx))
        trainer = token_logprobs(logits, tokens.reshape(logits.shape[:-1]), with_entropy=True)
        out = {"loss": -trainer.logprobs.mean(), "training_logprobs": trainer.logprobs,
               "logprobs": trainer.logprobs.detach().clone(), "mask": torch.ones(logits.shape[:-1]),
               "training_entropy": trainer.entropy, "training_varentropy": trainer.varentropy}
        return out | ({"sampler_facts": self.facts} if self.facts is not None else {})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_the_monitor_names_draws_at_another_temperature_and_logs_the_check() -> None:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=3, callbacks=[monitor]).fit(DrawingPolicy(0.7))
    found, temperature = monitor.last_diagnosis, monitor.last_metrics[PREFIX + "sampling_temperature"]
    # first order in T - 1, so a little low: 0.648-0.691 over 12 initial heads
    assert found.cause == "sampling" and abs(temperature - 0.7) < 0.07, (temperature, found.message)
    assert f"drawn sharper: effective temperature ≈ {temperature:.1f}" in found.message, found.message
    assert not found.is_observation  # inferred from what was sampled, not said by the engine
    assert "logprobs_mode='processed_logprobs'" in found.message
    assert monitor.last_metrics[PREFIX + "sampling_z"] > 20 and PREFIX + "sampling_temperature" in monitor.last_metrics
    honest = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))
    quiet_trainer(max_steps=3, callbacks=[honest]).fit(DrawingPolicy(1.0))
    assert honest.last_diagnosis.cause == "none" and abs(honest.last_metrics[PREFIX + "sampling_z"]) < 4


def test_the_engines_own_account_of_raw_logprobs_is_named_as_observed() -> None:
    facts = SamplerFacts(engine="vllm", logprobs_mode="raw_logprobs", temperature=1.0, top_p=0.9)
    found = diagnose({"frac_d_zero": 0.2, "relative_gap": 1e-6, "relative_gap_se": 1e-8}, n_tokens=1000, facts=facts)
    assert found.cause == "sampling" and found.confidence == 1.0 and found.is_observation
    assert "the vllm engine reports raw_logprobs while sampling with top-p 0.9" in found.message


def test_a_prefix_cache_kept_across_a_weight_reload_is_named_from_the_engines_account() -> None:
    sig = {"frac_d_zero": 0.0, "relative_gap": 0.3, "relative_gap_se": 0.01, "pearson": 0.9, "temperature": 1.0}
    found = diagnose(sig, n_tokens=1000, facts=SamplerFacts(engine="vllm", stale_prefix_cache=True))
    assert found.cause == "prefix_cache" and "prefix cache holds KV computed with older weights" in found.message
    assert "llm.reset_prefix_cache()" in found.message and found.is_observation
    assert diagnose(sig, n_tokens=1000, facts=SamplerFacts(engine="vllm", stale_prefix_cache=False)).cause != (
        "prefix_cache"
    )
    within_noise = sig | {"relative_gap": 1e-5}  # the cache outlived a reload but the logprobs agree: not the cause
    assert diagnose(within_noise, n_tokens=1000, facts=SamplerFacts(stale_prefix_cache=True)).cause == "precision"


def test_the_guard_rail_can_act_on_what_was_sampled_and_says_when_it_cannot() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_sampling_z=6.0), media=MediaOptions(log_worst_tokens=False))
    trainer = quiet_trainer(max_steps=3, callbacks=[monitor])
    trainer.fit(DrawingPolicy(0.7))
    assert trainer.should_stop and "sampling_z" in monitor.stop_reason and "exceeded max_sampling_z = 6" in (
        monitor.stop_reason
    )
    assert "drawn sharper" in monitor.stop_reason and "(a hint, confidence" in monitor.stop_reason  # inferred
    told = KLSampleTrainMonitor(guard_rail=GuardRail(max_sampling_z=6.0), media=MediaOptions(log_worst_tokens=False))
    facts = SamplerFacts(engine="vllm", logprobs_mode="raw_logprobs", temperature=0.7)
    quiet_trainer(max_steps=3, callbacks=[told]).fit(DrawingPolicy(0.7, facts))
    assert told.last_diagnosis.is_observation and told.stop_reason.endswith("(observed)."), told.stop_reason
    missing = KLSampleTrainMonitor(guard_rail=GuardRail(max_sampling_z=6.0), media=MediaOptions(log_worst_tokens=False))
    with pytest.warns(UserWarning, match="max_sampling_z = 6 is set but the step has no 'training_entropy'"):
        quiet_trainer(max_steps=2, callbacks=[missing]).fit(TinyPolicy())
    assert not missing.stop_reason and "|sampling_z| <= 6" in missing.summary_lines()[-1]
    with pytest.raises(ValueError, match="max_sampling_z"):
        KLSampleTrainMonitor(guard_rail=GuardRail(max_sampling_z=-1.0))


def test_an_engine_that_says_it_computes_in_float32_has_a_float32_prior() -> None:
    """Before calibration a gap a bf16 engine can leave is precision; from an engine that says it is float32,
    with a full-precision trainer, it is far beyond noise, with the slope at 1: another function (a failed load)."""
    from loops_callbacks.divergence.batch import DirectEvidence

    sig = {"frac_d_zero": 0.0, "relative_gap": 1e-4, "relative_gap_se": 1e-6, "pearson": 0.9999, "temperature": 1.0}
    assert diagnose(sig, n_tokens=1000).cause == "precision"
    fp32 = SamplerFacts(engine="vllm", dtype="float32")
    other = diagnose(sig, n_tokens=1000, facts=fp32)
    assert other.cause == "unrelated" and "their weights or their inputs differ" in other.message, other.message
    assert "full precision gap" not in other.message  # the marker is not a number to show
    near = sig | {"relative_gap": 5e-7, "relative_gap_se": 5e-9}  # beyond noise, but short of other weights
    assert diagnose(near, n_tokens=1000, facts=fp32).cause == "unclear"
    bf16_trainer = DirectEvidence(precision="bf16-mixed")
    assert diagnose(sig, n_tokens=1000, facts=fp32, evidence=bf16_trainer).cause == "precision"


def test_the_entropies_can_be_computed_on_logged_steps_only() -> None:
    """``logs_this_step`` answers for the optimizer step being trained, so the extra pass runs only when read."""
    asked: list[bool] = []

    class OnLoggedSteps(DrawingPolicy):
        def training_step(self, features: torch.Tensor, batch_idx: int) -> dict[str, Any]:
            logs = KLSampleTrainMonitor.logs_this_step(self.trainer)
            asked.append(logs)
            out = super().training_step(features, batch_idx)
            if not logs:
                out = {k: v for k, v in out.items() if not k.startswith("training_") or k == "training_logprobs"}
            return out

    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False), log_every_n_steps=2)
    quiet_trainer(max_steps=4, callbacks=[monitor]).fit(OnLoggedSteps(0.7))
    assert asked == [False, True, False, True] and monitor.last_diagnosis.cause == "sampling"
    scored = token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), with_entropy=True)
    assert set(scored.outputs) == {"training_logprobs", "training_entropy", "training_varentropy"}


def test_an_effective_temperature_is_said_only_where_the_first_order_estimate_means_one() -> None:
    from loops_callbacks.divergence.diagnosis import Diagnosis

    far = Diagnosis("sampling", 0.9, {"sampling_z": -2e5, "sampling_temperature": 2e5}).message
    assert "drawn flatter)" in far and "effective temperature" not in far
    near = Diagnosis("sampling", 0.9, {"sampling_z": 30.0, "sampling_temperature": 0.68}).message
    assert "drawn sharper: effective temperature ≈ 0.7" in near


def test_a_bias_of_one_sign_too_small_for_any_step_is_named_over_the_steps() -> None:
    """HF ``generate``'s default top-k 50 with raw logprobs left z between +1.75 and +4.04 on each of 12 SmolLM2
    steps: no step reaches 5, their sum over sqrt(n) (Stouffer) does; signs that disagree, or this step's the
    other way, do not add up."""
    sig = {"frac_d_zero": 1.0, "relative_gap": 0.0, "pearson": 1.0, "temperature": 1.0,
           "sampling_z": 2.5, "sampling_z_trimmed": 2.4}
    assert diagnose(sig, n_tokens=500).cause == "none"
    found = diagnose(sig, n_tokens=500, sampling_trend=[2.1, 3.0, 2.6])
    assert found.cause == "sampling" and found.numbers["sampling_steps"] == 4.0, found.message
    assert found.numbers["sampling_z_steps"] == pytest.approx((2.1 + 3.0 + 2.6 + 2.4) / 2)
    assert diagnose(sig, n_tokens=500, sampling_trend=[2.1, -3.0, 2.6]).cause == "none"
    other_way = sig | {"sampling_z": -2.5, "sampling_z_trimmed": -2.4}
    assert diagnose(other_way, n_tokens=500, sampling_trend=[2.1, 3.0, 2.6]).cause == "none"
    assert diagnose(sig, n_tokens=500, sampling_trend=[9.0] * 20 + [0.1] * 7).cause == "none"  # the latest 8 only


def test_the_sampling_trend_is_kept_in_the_checkpoint_and_skips_unchecked_steps() -> None:
    from loops_callbacks.divergence.diagnosis import Calibration

    calibration = Calibration()
    for z in (2.0, math.nan, 3.0):
        calibration.observe(Diagnosis("none", 1.0), {"relative_gap": 0.0, "sampling_z": z, "sampling_z_trimmed": z})
    assert calibration.recent_sampling_z == [2.0, 3.0]
    monitor = KLSampleTrainMonitor()
    monitor.calibration = calibration
    resumed = KLSampleTrainMonitor()
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.calibration.recent_sampling_z == [2.0, 3.0]
