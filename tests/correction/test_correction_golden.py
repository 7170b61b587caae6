"""The corrections equal TRL 1.16's and verl's own code on the same inputs (golden files).

``tests/golden/trl_correction_golden.json`` is written by ``make_trl_correction_golden.py`` with TRL
1.16.0 installed in a separate environment (TRL's four ``vllm_importance_sampling_mode`` modes,
copied verbatim from ``GRPOTrainer``, and its ``get_off_policy_mask``, imported);
``verl_correction_golden.json`` by ``make_verl_correction_golden.py`` executing verl's
``rollout_corr_helper.py`` at commit b178a3c. The peers compute in float32; this package in float64
from the same float32 inputs, so weights agree to a relative 1e-5 (the float32 rounding of a
sequence's summed log ratio and of ``exp``) and every keep / reject decision exactly.

Where a peer differs on purpose, the test says so: verl's truncated-IS weight is NaN where a
sampler logprob is NaN (and NaN poisons the loss); here such a token has log ratio 0, as in TRL.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from loops_callbacks.correction import Correction, apply_correction, parse_correction

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
TRL = json.loads((GOLDEN / "trl_correction_golden.json").read_text())
VERL = json.loads((GOLDEN / "verl_correction_golden.json").read_text())
RTOL, ATOL = 1e-5, 1e-7


def tensor(values: Any) -> torch.Tensor:
    """float32 tensor of nested lists with None as NaN."""
    return torch.tensor([[math.nan if v is None else v for v in row] for row in values], dtype=torch.float32)


TRL_INPUTS = {key: tensor(TRL["inputs"][key]) for key in ("trainer", "sampler", "mask")}
TRL_ADVANTAGES = torch.tensor(TRL["inputs"]["advantages"])
VERL_TRAINER, VERL_MASK = tensor(VERL["inputs"]["trainer"]), tensor(VERL["inputs"]["mask"])


def trl_case_id(case: dict) -> str:
    return f"{case['mode']}-min{case['clip_min']}-max{case['clip_max']}"


@pytest.mark.parametrize("case", TRL["importance_sampling"], ids=trl_case_id)
def test_trl_importance_sampling_modes(case: dict) -> None:
    correction = Correction(case["mode"], {"clip_min": case["clip_min"], "clip_max": case["clip_max"]})
    ours = apply_correction(correction, TRL_INPUTS["trainer"], TRL_INPUTS["sampler"], TRL_INPUTS["mask"])
    mask = TRL_INPUTS["mask"] > 0
    ratio = tensor(case["ratio"]).expand_as(mask)  # sequence modes: [B, 1]
    torch.testing.assert_close(ours.weights[mask], ratio[mask], rtol=RTOL, atol=ATOL)
    assert ours.weights.dtype == torch.float32
    assert not ours.weights[~mask].any(), "padding and prompt positions weigh 0"
    if case["invalid"] is None:  # truncate: every action token kept
        assert torch.equal(ours.keep, mask)
    else:
        invalid = torch.tensor(case["invalid"]).expand_as(mask)
        assert torch.equal(ours.keep, mask & ~invalid)


def test_the_trl_golden_exercises_both_outcomes() -> None:
    """Each mask mode drops some action tokens and keeps others; each truncate mode clips some."""
    mask = TRL_INPUTS["mask"] > 0
    for case in TRL["importance_sampling"]:
        if case["invalid"] is not None:
            invalid = torch.tensor(case["invalid"]).expand_as(mask)
            assert (invalid & mask).any() and (~invalid & mask).any(), trl_case_id(case)
    clipped = apply_correction("sequence_truncate", TRL_INPUTS["trainer"], TRL_INPUTS["sampler"], TRL_INPUTS["mask"])
    assert clipped.clipped.any() and (mask & ~clipped.clipped).any()


@pytest.mark.parametrize("case", TRL["off_policy_mask"], ids=lambda c: f"threshold{c['threshold']}")
def test_trl_off_policy_mask(case: dict) -> None:
    correction = Correction("off_policy_mask", {"threshold": case["threshold"]})
    ours = apply_correction(correction, TRL_INPUTS["trainer"], TRL_INPUTS["sampler"], TRL_INPUTS["mask"],
                            advantages=TRL_ADVANTAGES)
    mask = TRL_INPUTS["mask"] > 0
    kept_rows = torch.tensor(case["keep"]) > 0
    assert torch.equal(ours.keep, mask & kept_rows[:, None])
    assert torch.equal(ours.weights, ours.keep.to(torch.float32))


def test_the_off_policy_golden_drops_and_keeps_negative_advantage_rows() -> None:
    dropped = {i for case in TRL["off_policy_mask"] for i, keep in enumerate(case["keep"]) if keep == 0}
    negative = {i for i, a in enumerate(TRL["inputs"]["advantages"]) if a < 0}
    assert dropped and dropped < negative


def verl_sampler(form: str) -> torch.Tensor:
    return tensor(VERL["inputs"][f"sampler_{form}"])


@pytest.mark.parametrize("case", [c for c in VERL["truncated_is"] if c["form"] == "finite"],
                         ids=lambda c: f"{c['rollout_is']}-{c['threshold']}")
def test_verl_truncated_is(case: dict) -> None:
    method = "token_tis" if case["rollout_is"] == "token" else "sequence_tis"
    ours = apply_correction(Correction(method, {"threshold": case["threshold"]}), VERL_TRAINER, verl_sampler("finite"),
                            VERL_MASK)
    torch.testing.assert_close(ours.weights, tensor(case["weights"]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", [c for c in VERL["truncated_is"] if c["form"] == "nan"],
                         ids=lambda c: f"{c['rollout_is']}-{c['threshold']}")
def test_verl_truncated_is_with_nan_sampler_logprobs_is_finite_where_verl_is_nan(case: dict) -> None:
    """verl's weight is NaN at (token mode) or around (sequence mode) a NaN logprob; ours reads it as log ratio 0."""
    method = "token_tis" if case["rollout_is"] == "token" else "sequence_tis"
    ours = apply_correction(Correction(method, {"threshold": case["threshold"]}), VERL_TRAINER, verl_sampler("nan"),
                            VERL_MASK)
    theirs = tensor(case["weights"])
    assert torch.isnan(theirs[VERL_MASK > 0]).any() and torch.isfinite(ours.weights).all()
    same = (case["rollout_is"], case["threshold"])
    finite = next(
        c for c in VERL["truncated_is"] if c["form"] == "finite" and (c["rollout_is"], c["threshold"]) == same
    )
    torch.testing.assert_close(ours.weights, tensor(finite["weights"]), rtol=RTOL, atol=ATOL)
    known = ~torch.isnan(theirs)
    torch.testing.assert_close(ours.weights[known], theirs[known], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", VERL["rejection"], ids=lambda c: f"{c['form']}-{c['rollout_rs']}-{c['threshold']}")
def test_verl_rejection(case: dict) -> None:
    threshold = str(case["threshold"])
    correction = parse_correction(f"{case['rollout_rs']}:{threshold}")
    ours = apply_correction(correction, VERL_TRAINER, verl_sampler(case["form"]), VERL_MASK)
    theirs = torch.tensor(case["mask"]) > 0
    assert torch.equal(ours.keep, theirs)
    assert torch.equal(ours.weights, theirs.to(torch.float32))


def test_the_verl_golden_rejects_some_and_keeps_some() -> None:
    mask = VERL_MASK > 0
    for case in VERL["rejection"]:
        kept = torch.tensor(case["mask"]) > 0
        assert kept.any(), case["rollout_rs"]
    assert any(((torch.tensor(c["mask"]) == 0) & mask).any() for c in VERL["rejection"] if c["form"] == "finite")


def test_geo_is_verls_geometric_mean_rejection() -> None:
    case = next(c for c in VERL["rejection"] if c["rollout_rs"] == "seq_mean_k1" and c["threshold"] == "0.999_1.001"
                and c["form"] == "finite")
    ours = apply_correction("geo", VERL_TRAINER, verl_sampler("finite"), VERL_MASK)
    theirs = torch.tensor(case["mask"]) > 0
    assert torch.equal(ours.keep, theirs)
    rows_kept = theirs.any(dim=1)
    assert rows_kept.any() and not rows_kept[(VERL_MASK > 0).any(dim=1)].all()


def copied_trl() -> Any:
    """``make_trl_correction_golden.py``: TRL 1.16's importance-sampling lines, copied verbatim (torch only)."""
    path = GOLDEN / "make_trl_correction_golden.py"
    spec = importlib.util.spec_from_file_location("make_trl_correction_golden", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_sequence_with_a_plus_and_a_minus_infinite_log_ratio_has_trls_ratio() -> None:
    """TRL's ``nan_to_num(diff, nan=0.0)`` maps ±inf to ±finfo.max, which cancel in a row with one of each; here
    such tokens are read as missing (NaN, as the main metrics skip them), so the row's ratio is its other tokens'
    in every sequence-level method. TRL's own sum depends on the order of the additions once more than one
    infinity is on a side, and its token modes give the infinite tokens a ratio of inf or 0 (ours: 1)."""
    inf = math.inf
    trainer, sampler, mask = torch.full((1, 4), -1.0), torch.tensor([[-inf, inf, -1.2, -1.0]]), torch.ones(1, 4)
    trl = copied_trl()
    for mode in ("sequence_truncate", "sequence_mask"):
        ratio, _ = trl.trl_importance_sampling_ratio(trainer, sampler, mask, mode, None, 3.0)
        ours = apply_correction(mode, trainer, sampler, mask)
        assert ratio.item() == pytest.approx(math.exp(0.2), rel=1e-6)
        torch.testing.assert_close(ours.weights, ratio.expand_as(mask), rtol=RTOL, atol=ATOL)
    tis = apply_correction("sequence_tis", trainer, sampler, mask)  # verl's own sum is NaN here
    torch.testing.assert_close(tis.weights, ratio.expand_as(mask), rtol=RTOL, atol=ATOL)
