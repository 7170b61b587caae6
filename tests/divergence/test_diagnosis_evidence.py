"""Direct evidence about the trainer (live dropout, precision) and how the diagnosis ranks it above statistics."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loops_callbacks.divergence.diagnosis import CAUSES, DROPOUT, Calibration, diagnosis_metrics
from loops_callbacks.divergence.diagnosis import diagnose
from loops_callbacks.divergence.batch import DirectEvidence, observe_modules, observe_training
from loops_callbacks.divergence.guard_rail import GuardRail
from loops_callbacks.divergence.report import ReportOptions, step_report
from loops_callbacks.divergence.history import RunHistory
from loops_callbacks.divergence.statistics import signature_numbers
from tests.divergence.test_diagnosis import case, host_of


def _gpt2(dropout: float = 0.1) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_dropout_layers_are_counted_by_p_in_training_mode_only() -> None:
    model = _gpt2()
    seen = observe_modules(model.train(), precision="bf16-mixed")
    assert seen.dropout_active and seen.dropout_modules == 1 + 3 * 2  # embeddings, then attn / resid / mlp per layer
    assert seen.max_dropout_p == pytest.approx(0.1)
    assert seen.facts.startswith("7 Dropout modules with p = 0.1 are in training mode")
    assert "the trainer's precision is bf16-mixed" in seen.facts and seen.reduced_precision
    assert not observe_modules(model.eval(), precision=None).dropout_active
    assert not observe_modules(_gpt2(dropout=0.0).train(), precision=None).dropout_active


def test_functional_attention_dropout_of_llama_is_seen() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, attention_dropout=0.05,
    )
    seen = observe_modules(transformers.LlamaForCausalLM(config).train(), precision=None)
    assert [(s.kind, s.p, s.count) for s in seen.dropout] == [("LlamaAttention.attention_dropout", 0.05, 2)]
    assert seen.facts.startswith("2 LlamaAttention modules with attention_dropout = 0.05 are in training mode")


def test_observe_training_reads_the_trainers_precision_and_never_raises() -> None:
    class Trainer:
        precision = "32-true"

    module = torch.nn.Sequential(torch.nn.Dropout(0.2))
    assert observe_training(Trainer(), module).precision == "32-true"
    assert observe_training(object(), module).precision is None


def test_live_dropout_is_named_as_an_observation_before_any_statistical_cause() -> None:
    evidence = DirectEvidence(observe_modules(_gpt2().train(), precision=None).dropout)
    assert DROPOUT in CAUSES
    for cause in ("stale", "temperature", "precision", "unrelated"):
        host = host_of(case(cause))
        sig = signature_numbers(host)
        statistical = diagnose(sig, n_tokens=host.totals["n_action_tokens"])
        found = diagnose(sig, n_tokens=host.totals["n_action_tokens"], evidence=evidence)
        assert statistical.cause != DROPOUT
        assert found.cause == DROPOUT and found.confidence == 1.0 and found.is_observation, cause
        assert found.message.startswith(
            "likely cause: observed: the trainer's logprobs include dropout noise: 7 Dropout modules with p = 0.1"
        )
        assert "model.eval()" in found.message


def test_live_dropout_does_not_hide_an_offset_or_a_gap_growing_with_the_lag_or_over_the_steps() -> None:
    """A dropout layer the logprobs never pass through (a value head), or dropout beside a real fault, must not
    mask what dropout cannot explain: an offset, a gap growing with the policy lag or over the steps. Both are
    said, the observation first."""
    evidence = DirectEvidence(observe_modules(_gpt2().train(), precision=None).dropout)
    sig = {"frac_d_zero": 0.0, "offset": 3.0, "offset_share": 1.0, "offset_ratio": 1e-6, "pearson": 0.1,
           "kl_sample_train_k3": 1.5}
    found = diagnose(sig, n_tokens=900, evidence=evidence)
    assert found.cause == DROPOUT and found.beyond.cause == "shift" and found.label == "dropout + shift"
    assert found.message.startswith("likely cause: observed: the trainer's logprobs include dropout noise: 7 Dropout")
    assert "; and beyond what dropout explains: sampler logprobs are shifted by 3 positions" in found.message

    @dataclass(frozen=True)
    class Lag:
        n_tokens: float
        abs_d_mean: float

    by_lag = {"0": Lag(500, 0.02), "1": Lag(500, 0.4)}
    found = diagnose(signature_numbers(host_of(case("unrelated"))), n_tokens=1024, evidence=evidence, by_lag=by_lag)
    assert found.label == "dropout + stale" and "lag growth" in found.message
    metrics = diagnosis_metrics(found, {}, prefix="")
    assert metrics["diagnosis/dropout"] == metrics["diagnosis/stale"] == 1.0 and metrics["diagnosis/shift"] == 0.0
    # a gap growing over the steps while dropout noise keeps it off the floor from the start (never synced)
    sig = signature_numbers(host_of(case("stale")))
    gap = sig["relative_gap"]
    found = diagnose(sig, n_tokens=1024, evidence=evidence, trend=(0.1 * gap, 0.3 * gap, 0.6 * gap))
    assert found.label == "dropout + stale" and "gap growth" in found.message
    level = diagnose(sig, n_tokens=1024, evidence=evidence, trend=(gap, 0.9 * gap, 1.1 * gap))  # dropout's own level
    assert level.label == DROPOUT


def test_dropout_that_does_not_reach_the_logprobs_is_not_named() -> None:
    evidence = observe_modules(torch.nn.Sequential(torch.nn.Dropout(0.1)), precision=None)
    host = host_of(case("none"))
    found = diagnose(signature_numbers(host), n_tokens=host.totals["n_action_tokens"], evidence=evidence)
    assert found.cause == "none"


def test_step_report_passes_the_evidence_and_the_history_says_observed() -> None:
    evidence = observe_modules(torch.nn.Sequential(torch.nn.Dropout(0.1)), precision="32-true")
    guard_rail = GuardRail(None, "kl_sample_train_k3")
    options = ReportOptions(prefix="div/")
    host = host_of(case("stale"))
    calibrated = Calibration(calibration_steps=1, healthy_gaps=[1e-6])  # a run calibrated on its healthy steps
    assert step_report(host, options, guard_rail=guard_rail, calibration=calibrated).diagnosis.cause == "stale"
    report = step_report(host, options, guard_rail=guard_rail, evidence=evidence)
    assert report.diagnosis.cause == DROPOUT and report.breakdown["diagnosis/dropout"] == 1.0
    history = RunHistory()
    history.observe(3, report.scalars, report.diagnosis)
    [line] = [line for line in history.lines("div/") if line.startswith("  last diagnosis")]
    assert line.startswith("  last diagnosis (step 3, observed, confidence 1.00): likely cause: observed: ")
