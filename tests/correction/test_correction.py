"""Rollout corrections as functions: specs, input checks, padding, and the flat form equal to the padded one."""

from __future__ import annotations

import copy
import math
import pickle
import re
from pathlib import Path

import pytest
import torch

from loops_callbacks.correction import METHODS, Correction, apply_correction, parse_correction
from loops_callbacks.correction.compute import CorrectionInput, Segments, correct_flat, correct_rows

NEEDS_BOUND = {"token_k1": "2.0", "token_k2": "0.1", "token_k3": "0.05", "seq_sum_k1": "0.5_2.0", "seq_sum_k2": "1.0",
               "seq_sum_k3": "0.5", "seq_mean_k1": "0.9_1.1", "seq_mean_k2": "0.01", "seq_mean_k3": "0.01",
               "seq_max_k2": "0.5", "seq_max_k3": "0.5", "off_policy_mask": "0.01"}
SPECS = [f"{m}:{NEEDS_BOUND[m]}" if m in NEEDS_BOUND else m for m in METHODS]


def batch(seed: int = 0, rows: int = 6, width: int = 10) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(rows, width, generator=generator) * 3
    sampler = trainer - torch.randn(rows, width, generator=generator) * torch.linspace(0.01, 0.6, rows)[:, None]
    lengths = torch.randint(0, width + 1, (rows,), generator=generator)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    sampler[1, 0] = math.nan
    advantages = torch.randn(rows, generator=generator)
    return {"trainer": trainer, "sampler": sampler, "mask": mask, "advantages": advantages}


def test_string_forms_and_the_dataclass_are_one_correction() -> None:
    assert parse_correction("sequence_mask") == parse_correction("sequence_mask:3.0") == Correction("sequence_mask")
    assert parse_correction("token_truncate(clip_max=2.0)") == Correction("token_truncate", {"clip_max": 2.0})
    assert parse_correction("token_mask:0.5_2") == Correction("token_mask", {"clip_min": 0.5, "clip_max": 2.0})
    assert parse_correction("token_mask(clip_max=None)").params == {"clip_min": None, "clip_max": None}
    assert parse_correction("token_mask:0_2").params == {"clip_min": 0.0, "clip_max": 2.0}  # TRL allows clip_min 0
    assert parse_correction("off_policy_mask:-0.1").params == {"threshold": -0.1}  # δ bounds a mean KL estimate
    assert parse_correction(" geo ") == Correction("geo")
    assert dict(Correction("geo").params) == {"lower": 0.999, "upper": 1.001}
    # verl reads one seq_mean_k1 threshold x as [1/x, x]; geo is seq_mean_k1 with a preset
    assert dict(parse_correction("geo:1.01").params) == dict(parse_correction("seq_mean_k1:1.01").params)
    assert dict(Correction("geo", {"upper": 1.01}).params) == {"lower": 1 / 1.01, "upper": 1.01}
    assert dict(parse_correction("geo:0.99_1.01").params) == {"lower": 0.99, "upper": 1.01}
    correction = Correction("icepop")
    assert parse_correction(correction) is correction
    assert len({parse_correction("sequence_mask"), Correction("sequence_mask", {"clip_max": 3})}) == 1
    with pytest.raises(TypeError):
        correction.params["clip_max"] = 1.0  # type: ignore[index]


def test_a_correction_pickles_and_copies_as_itself() -> None:
    """ddp_spawn pickles the callbacks, and with them their corrections."""
    correction = parse_correction("token_mask:0.5_2.0")
    assert pickle.loads(pickle.dumps(correction)) == correction
    assert copy.deepcopy(correction) == correction
    assert repr(correction) == "Correction('token_mask', {'clip_min': 0.5, 'clip_max': 2.0})"


def test_names_show_only_what_differs_from_the_framework_default() -> None:
    assert Correction("sequence_mask").name == "sequence_mask"
    assert parse_correction("sequence_mask:2.0").name == "sequence_mask(clip_max=2.0)"
    assert parse_correction("token_k1:2.0").name == "token_k1(lower=0.5, upper=2.0)"


@pytest.mark.parametrize(("spec", "error", "words"), [
    ("nope", ValueError, "unknown method 'nope'"),
    ("token_k3", ValueError, "needs 'upper'"),
    ("off_policy_mask", ValueError, "needs 'threshold'"),
    ("token_mask(clip=1)", ValueError, "no parameter ['clip']"),
    ("token_mask(clip_max)", ValueError, "not name=value"),
    ("token_mask:abc", ValueError, "'abc' is not a number"),
    ("token_mask:3_1", ValueError, "lower bound 3.0 is above the upper bound 1.0"),
    ("token_tis:-2", ValueError, "'threshold' must be positive"),
    ("token_k2:1_2", ValueError, "takes upper; got 2 values"),
    ("token_k1(upper=None)", ValueError, "'upper' must be a number (only TRL's clips can be None)"),
    ("seq_sum_k3:0", ValueError, "'upper' must be positive, got 0.0"),
    ("token_k1:0.5", ValueError, "lower bound 2.0 is above the upper bound 0.5"),
    ("token mask", ValueError, "cannot read correction"),
    (3.0, TypeError, "got float"),
    ("sequence_mask(clip_max=2, clip_max=5)", ValueError,
     "correction 'sequence_mask(clip_max=2, clip_max=5)': 'clip_max' is given twice"),
    ("sequence_mask:1e400", ValueError, "correction 'sequence_mask': 'clip_max' must be a finite number"),
    ("token_tis(threshold=-inf)", ValueError, "correction 'token_tis': 'threshold' must be a finite number"),
])
def test_bad_specs_say_what_is_wrong(spec: object, error: type, words: str) -> None:
    with pytest.raises(error, match=re.escape(words)):
        parse_correction(spec)  # type: ignore[arg-type]


def test_a_dataclass_with_a_wrong_value_is_refused() -> None:
    with pytest.raises(TypeError, match="'clip_max' must be a finite number .* or None, got '3'"):
        Correction("token_mask", {"clip_max": "3"})
    with pytest.raises(ValueError, match=r"correction 'sequence_mask': 'clip_max' must be a finite number \(\|x\| <= "
                                         r"3.4e\+38, float32's range\) or None, got 1797"):
        Correction("sequence_mask", {"clip_max": 2**1024})  # no float holds it: an OverflowError naming nothing
    with pytest.raises(TypeError, match="params must be a mapping"):
        Correction("token_mask", [("clip_max", 3.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", SPECS)
def test_inputs_are_not_modified_and_weights_carry_no_gradient(spec: str) -> None:
    inputs = batch()
    trainer = inputs["trainer"].clone().requires_grad_(True)
    before = {k: v.clone() for k, v in inputs.items()}
    result = apply_correction(spec, trainer, inputs["sampler"], inputs["mask"], advantages=inputs["advantages"])
    for key, value in before.items():
        assert torch.equal(value, inputs[key]) or torch.equal(value.isnan(), inputs[key].isnan()), key
    assert torch.equal(trainer.detach(), inputs["trainer"])
    assert not result.weights.requires_grad
    mask = inputs["mask"] > 0
    assert not result.weights[~mask].any() and not result.keep[~mask].any()
    assert torch.isfinite(result.weights).all()
    assert not (result.weights[mask & ~result.keep]).any(), "a dropped token weighs 0"
    assert not (result.clipped & ~result.keep).any()


@pytest.mark.parametrize("spec", SPECS)
def test_the_flat_form_of_ragged_rows_equals_the_padded_form(spec: str) -> None:
    """``correct_flat`` over ragged rows (the monitor's form) equals ``apply_correction`` on the padded rows."""
    inputs = batch(seed=3)
    correction = parse_correction(spec)
    padded = apply_correction(correction, inputs["trainer"], inputs["sampler"], inputs["mask"],
                              advantages=inputs["advantages"])
    lengths = inputs["mask"].sum(dim=1).long()
    keep_positions = inputs["mask"] > 0
    log_ratio = (inputs["trainer"].double() - inputs["sampler"].double())[keep_positions]
    rows = Segments(lengths, total=int(lengths.sum()))
    x = CorrectionInput(log_ratio, torch.ones_like(log_ratio, dtype=torch.bool), rows, inputs["advantages"].double())
    flat = correct_flat(correction, x)
    torch.testing.assert_close(flat.weights.float(), padded.weights[keep_positions], rtol=0, atol=0)
    assert torch.equal(flat.keep, padded.keep[keep_positions])
    assert torch.equal(flat.clipped, padded.clipped[keep_positions])


@pytest.mark.parametrize("spec", [s for s in SPECS if METHODS[s.split(":")[0]].level == "sequence"])
def test_sequence_corrections_keep_or_drop_whole_sequences(spec: str) -> None:
    inputs = batch(seed=5, rows=12)
    result = apply_correction(spec, inputs["trainer"], inputs["sampler"], inputs["mask"],
                              advantages=inputs["advantages"])
    mask = inputs["mask"] > 0
    kept_any = (result.keep & mask).any(dim=1)
    assert torch.equal(result.keep, mask & kept_any[:, None])


def test_icepop_is_the_two_sided_token_mask_at_half_and_five() -> None:
    inputs = batch(seed=1)
    args = inputs["trainer"], inputs["sampler"] - 1.5 * torch.randn(inputs["sampler"].shape), inputs["mask"]
    icepop, token_mask = apply_correction("icepop", *args), apply_correction("token_mask:0.5_5.0", *args)
    assert torch.equal(icepop.weights, token_mask.weights) and torch.equal(icepop.keep, token_mask.keep)
    assert (~icepop.keep & (inputs["mask"] > 0)).any()


def test_a_small_gap_over_a_long_sequence_is_masked_by_the_sequence_ratio() -> None:
    """TRL #4772: 0.012 nats per token over 100 tokens is a sequence ratio e^1.2 = 3.3 > 3: sequence_mask drops it."""
    trainer = torch.full((1, 100), -1.0)
    sampler = trainer - 0.012
    mask = torch.ones(1, 100)
    assert not apply_correction("sequence_mask", trainer, sampler, mask).keep.any()
    assert apply_correction("token_mask", trainer, sampler, mask).keep.all()
    truncated = apply_correction("sequence_truncate", trainer, sampler, mask)
    assert truncated.weights.eq(3.0).all() and truncated.clipped.all()


def test_an_empty_mask_gives_zero_weights() -> None:
    inputs = batch()
    for spec in SPECS:
        result = apply_correction(spec, inputs["trainer"], inputs["sampler"], torch.zeros_like(inputs["mask"]),
                                  advantages=inputs["advantages"])
        assert not result.weights.any() and not result.keep.any(), spec


def test_a_non_finite_log_ratio_is_read_as_missing_whatever_the_method() -> None:
    """A ±inf logprob is skipped by the main metrics as a NaN one is, so every correction reads it as NaN:
    a sequence with a +inf and a -inf log ratio is judged on its other tokens (verl's sum was NaN, kept)."""
    inputs = batch(seed=4)
    trainer, sampler = inputs["trainer"].clone(), inputs["sampler"].clone()
    sampler[0, 1], sampler[0, 4], trainer[0, 7] = -math.inf, math.inf, -math.inf  # row 0 is full length
    sampler[3, 0] = -math.inf
    missing = sampler.masked_fill(~torch.isfinite(trainer - sampler), math.nan)
    for spec in SPECS:
        ours = apply_correction(spec, trainer, sampler, inputs["mask"], advantages=inputs["advantages"])
        want = apply_correction(spec, trainer, missing, inputs["mask"], advantages=inputs["advantages"])
        assert torch.isfinite(ours.weights).all(), spec
        assert torch.equal(ours.weights, want.weights) and torch.equal(ours.keep, want.keep), spec
        assert torch.equal(ours.clipped, want.clipped), spec
    tis = apply_correction("sequence_tis", torch.full((1, 3), -1.0), torch.tensor([[-math.inf, math.inf, -1.2]]),
                           torch.ones(1, 3))
    assert tis.keep.all() and tis.weights[0].tolist() == pytest.approx([math.exp(0.2)] * 3, rel=1e-6)


def test_a_bound_beyond_the_range_of_16_bit_logprobs_is_kept() -> None:
    """Weights are float32 at least: fp16 (max 65504) would turn a cap of 1e5 into inf."""
    trainer, sampler = torch.zeros(1, 3, dtype=torch.float16), torch.full((1, 3), -5.0, dtype=torch.float16)
    result = apply_correction("sequence_truncate(clip_max=100000)", trainer, sampler, torch.ones(1, 3))
    assert result.weights.dtype == torch.float32 and result.weights.tolist() == [[100000.0] * 3]  # e^15 capped


def test_weights_are_float32_or_the_trainer_logprobs_wider_dtype() -> None:
    inputs = batch()
    result = apply_correction("token_tis", inputs["trainer"].bfloat16(), inputs["sampler"], inputs["mask"])
    assert result.weights.dtype == torch.float32 and result.log_ratio.dtype == torch.float64
    result = apply_correction("token_tis", inputs["trainer"].double(), inputs["sampler"], inputs["mask"])
    assert result.weights.dtype == torch.float64


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"sampler_logprobs": torch.zeros(2, 4)}, ValueError,
     r"'sampler_logprobs' has shape \(2, 4\) but 'trainer_logprobs' has \(2, 3\)"),
    ({"mask": torch.ones(2, 3, 1)}, ValueError, r"'mask' must be a \[B, T\] tensor, got shape \(2, 3, 1\)"),
    ({"trainer_logprobs": [[0.0]]}, TypeError, "'trainer_logprobs' must be a"),
    ({"sampler_logprobs": torch.zeros(2, 3, dtype=torch.int64)}, TypeError, "'sampler_logprobs' must hold floating"),
    ({"advantages": torch.zeros(3)}, ValueError, r"'advantages' has shape \(3,\); expected \(2,\) or \(2, 1\)"),
    ({"advantages": [1.0, 2.0]}, TypeError, "'advantages' must be a tensor"),
])
def test_bad_inputs_name_the_key_and_the_shapes(kwargs: dict, error: type, words: str) -> None:
    args = {"trainer_logprobs": torch.zeros(2, 3), "sampler_logprobs": torch.zeros(2, 3), "mask": torch.ones(2, 3)}
    args.update(kwargs)
    with pytest.raises(error, match=words):
        apply_correction("sequence_mask", **args)


def test_the_off_policy_mask_needs_advantages() -> None:
    with pytest.raises(ValueError, match=r"needs 'advantages' of shape \(2,\)"):
        apply_correction("off_policy_mask:0.1", torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
    kept = apply_correction("off_policy_mask:0.1", torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3),
                            advantages=torch.tensor([[1.0], [-1.0]]))
    assert kept.keep.tolist() == [[True] * 3, [False] * 3]  # mean KL 1 > 0.1, dropped only with A < 0
    unjudged = apply_correction("off_policy_mask:0.1", torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3),
                                advantages=torch.tensor([math.nan, 1.0]))
    assert unjudged.keep.tolist() == [[False] * 3, [True] * 3]  # a NaN advantage cannot be judged: not kept


def test_the_docs_block_weights_the_loss_as_written() -> None:
    """docs/corrections.md's two lines (the correction, then the loss), run on a batch where some sequences are
    above TRL's cap: their tokens get no gradient, padding none either."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "corrections.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL) if "apply_correction(" in b]
    assert len(blocks) == 1
    lines = "\n".join(line for line in blocks[0].splitlines() if line.startswith(("from ", "result =", "loss =")))
    inputs = batch(seed=2)
    trainer = inputs["trainer"].clone().requires_grad_(True)
    namespace = {"trainer_logprobs": trainer, "sampler_logprobs": inputs["sampler"], "mask": inputs["mask"],
                 "advantages": inputs["advantages"]}
    exec(compile(lines, "docs/corrections.md", "exec"), namespace)
    namespace["loss"].backward()
    assert torch.isfinite(trainer.grad).all() and trainer.grad[inputs["mask"] == 0].eq(0).all()
    dropped = (inputs["mask"] > 0) & ~namespace["result"].keep
    assert dropped.any() and trainer.grad[dropped].eq(0).all()  # some sequences are above TRL's cap of 3.0


def test_a_token_level_correction_is_refused_per_row() -> None:
    x = CorrectionInput(torch.tensor([0.5, 0.5, 0.1], dtype=torch.float64), torch.tensor([True, True, True]),
                        Segments(torch.tensor([2, 1]), total=3))
    with pytest.raises(ValueError, match="is token-level; use correct_flat"):
        correct_rows(parse_correction("token_truncate:2.0"), x)
