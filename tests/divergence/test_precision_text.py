"""The precision cause says bf16 only where a 16-bit side is known: an engine in float32 is not told of bf16 kernels."""

from __future__ import annotations

from loops_callbacks.divergence.diagnosis import diagnose
from loops_callbacks.divergence.batch import DirectEvidence, SamplerFacts
from tests.divergence.test_diagnosis_facts import QUIET

TINY = QUIET | {"relative_gap": 1e-9, "kl_sample_train_k3": 1e-12}
"""Within the noise of a full-precision engine too."""


def test_a_float32_engine_is_not_told_of_bf16_kernels() -> None:
    for dtype in ("float32", "float64"):
        found = diagnose(TINY, n_tokens=1000, facts=SamplerFacts(engine="vllm", dtype=dtype),
                         evidence=DirectEvidence(precision="32-true"))
        assert found.cause == "precision", found.message
        assert "bf16" not in found.message and "16-bit" not in found.message, found.message
        assert "numerical precision (kernels and reduction order differ between the engines)" in found.message


def test_bf16_is_said_where_a_16_bit_side_is_known() -> None:
    sides = {
        "the engine": {"facts": SamplerFacts(engine="vllm", dtype="bfloat16")},
        "the trainer": {"facts": SamplerFacts(engine="vllm", dtype="float32"),
                        "evidence": DirectEvidence(precision="bf16-mixed")},
        "both logprobs": {"signatures": TINY | {"both_16_bit_share": 1.0, "frac_d_zero": 0.5}},
    }
    for side, given in sides.items():
        signatures = given.pop("signatures", QUIET)
        found = diagnose(signatures, n_tokens=1000, **given)
        assert found.cause == "precision", (side, found.message)
        assert "numerical precision (16-bit rounding, e.g. bf16 kernels)" in found.message, (side, found.message)
        assert "16 bit" not in found.message, found.message  # the flag picks the text; it is not one of the numbers


def test_an_unknown_precision_names_neither() -> None:
    found = diagnose(QUIET, n_tokens=1000)
    assert found.cause == "precision"
    assert "numerical precision (the engines' dtypes, kernels or reduction order differ)" in found.message
    assert "e.g. bf16" not in found.message
