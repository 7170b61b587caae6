"""A gap concentrated on each completion's first tokens (a template, BOS or system-prompt difference,
a prefix cache from older weights) is said at any size, as ``unclear`` with the fade and what to
check: never precision or staleness, and never named a context difference, since an engine whose
error grows along the completion's first tokens leaves the same fade. Rounding noise spread along the
completion has none."""

from __future__ import annotations

import math

import torch

from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.diagnosis import diagnose
from loops_callbacks.divergence.statistics import signature_numbers
from loops_callbacks.divergence.statistics import CONTEXT_KINDS, PROBABILITY_STRATA, context_total
from loops_callbacks.divergence.statistics import DivergenceStats
from loops_callbacks.divergence.statistics import FIRST_ACTIONS, LATER_ACTIONS_FROM
from tests.divergence.test_diagnosis import host_of

B, T, V = 64, 24, 14


def sampled(trainer_logits: torch.Tensor, sampler_logits: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A padded batch whose tokens the sampler drew from its logits, with both sides' logprobs of them."""
    rows, width, vocab = trainer_logits.shape
    sampler_lp = torch.log_softmax(sampler_logits, -1)
    tokens = torch.multinomial(sampler_lp.exp().reshape(-1, vocab), 1, generator=g).reshape(rows, width)
    return {
        "sampler_logprobs": sampler_lp.gather(-1, tokens[..., None])[..., 0],
        "training_logprobs": torch.log_softmax(trainer_logits, -1).gather(-1, tokens[..., None])[..., 0],
        "mask": torch.ones(rows, width),
        "target_tokens": tokens,
    }


def faded_context(size: float, *, width: int = T, seed: int = 0) -> dict[str, torch.Tensor]:
    """The sampler saw another prompt: its logits differ from the trainer's by a per-datum change
    of the context that fades along the completion (``size`` at its first token)."""
    g = torch.Generator().manual_seed(seed)
    trainer_logits = 2.5 * torch.randn(B, width, V, generator=g)
    fade = torch.exp(-torch.arange(width, dtype=torch.float32) / 2.0)[None, :, None]
    return sampled(trainer_logits, trainer_logits + size * fade * torch.randn(B, 1, V, generator=g), g)


def rounding_noise(width: int = T, seed: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 sampler: rounding noise of the same size at every position."""
    g = torch.Generator().manual_seed(seed)
    trainer_logits = 2.5 * torch.randn(B, width, V, generator=g)
    return sampled(trainer_logits, trainer_logits.bfloat16().float(), g)


def test_a_small_gap_that_fades_along_the_completion_is_said_not_called_precision() -> None:
    host = host_of(faded_context(0.05))
    sig = signature_numbers(host)
    assert sig["kl_sample_train_k3"] < 1e-3  # as small as a bf16 engine's gap: the precision rule would take it
    found = diagnose(sig, n_tokens=host.totals["n_action_tokens"])
    assert sig["context_fade"] > 3 and sig["context_fade_z"] > 3 and found.cause == "unclear"
    assert "first tokens" in found.message and "chat template" in found.message and "KV cache" in found.message
    assert "context fade" in found.message and found.numbers["context_fade"] == sig["context_fade"]


def test_a_large_gap_that_fades_is_said_too() -> None:
    sig = signature_numbers(host_of(faded_context(2.0)))
    found = diagnose(sig, n_tokens=B * T)
    assert sig["kl_sample_train_k3"] > 1e-2 and found.cause == "unclear" and "context_fade" in found.numbers


def test_rounding_noise_spread_along_the_completion_has_no_fade_and_stays_precision() -> None:
    sig = signature_numbers(host_of(rounding_noise()))
    assert 0.8 < sig["context_fade"] < 1.25
    assert diagnose(sig, n_tokens=B * T).cause == "precision"


def test_completions_too_short_for_later_tokens_have_no_fade() -> None:
    """With fewer than ``LATER_ACTIONS_FROM + 1`` action tokens per datum there is nothing to compare."""
    sig = signature_numbers(host_of(faded_context(0.05, width=LATER_ACTIONS_FROM)))
    found = diagnose(sig, n_tokens=B * LATER_ACTIONS_FROM)
    assert math.isnan(sig["context_fade"]) and "context_fade" not in found.numbers


def test_first_and_later_action_tokens_are_counted_per_datum_from_its_own_first_action() -> None:
    """Right-padded rows whose completions start at different positions, a row with no action token,
    and a masked-out gap inside a row (a tool response between two turns): ranks count action tokens only."""
    width = 16
    mask = torch.zeros(4, width)
    mask[0, 3:] = 1.0  # 13 action tokens from position 3
    mask[1, 10:] = 1.0  # 6: none later
    mask[3, 0:5] = 1.0  # 5, a masked gap, then 7 more: 12 in all
    mask[3, 9:] = 1.0
    d = torch.arange(4 * width, dtype=torch.float32).reshape(4, width) / 100
    flat = flatten_padded(sampler_logprobs=torch.zeros(4, width), training_logprobs=-d, mask=mask)
    host = DivergenceStats.from_batch(flat).to_host().totals
    totals = {kind: sum(host[context_total(kind, bucket)] for bucket in range(len(PROBABILITY_STRATA)))
              for kind in CONTEXT_KINDS}
    first = later = 0
    sum_first = sum_later = 0.0
    for row in range(4):  # the definition, one token at a time
        actions = mask[row].nonzero()[:, 0].tolist()
        for rank, position in enumerate(actions):
            value = float(d[row, position])
            if rank < FIRST_ACTIONS:
                first, sum_first = first + 1, sum_first + value
            if rank >= LATER_ACTIONS_FROM:
                later, sum_later = later + 1, sum_later + value
    assert (totals["n_first"], totals["n_later"]) == (first, later) == (12, 9)
    assert math.isclose(totals["sum_abs_d_first"], sum_first, rel_tol=1e-6)
    assert math.isclose(totals["sum_abs_d_later"], sum_later, rel_tol=1e-6)


def test_a_temperature_on_completions_whose_first_tokens_are_harder_is_not_a_context_difference() -> None:
    """Where the first tokens are less predictable (flatter distributions), a one-sided temperature moves
    them more: |d| alone fades along the completion, but not among tokens of the same sampler probability."""
    g = torch.Generator().manual_seed(1)
    trainer_logits = 0.3 * torch.randn(B * 4, T, V, generator=g)
    trainer_logits[..., 0] += torch.linspace(2.0, 6.0, T)  # one likely token: p about 0.35 first, 0.97 later
    batch = sampled(trainer_logits, trainer_logits / 0.8, g)
    d = (batch["training_logprobs"] - batch["sampler_logprobs"]).abs()
    assert d[:, :FIRST_ACTIONS].mean() > 1.5 * d[:, LATER_ACTIONS_FROM:].mean()  # the unstratified ratio would say context
    host = host_of(batch)
    sig = signature_numbers(host)
    assert sig["context_fade"] < 1.3
    assert "context_fade" not in diagnose(sig, n_tokens=host.totals["n_action_tokens"]).numbers


def scaled_logits(first: float, later: float, top_k: int, seed: int) -> dict[str, torch.Tensor]:
    """Both sides see the same prompt and logits; the logits' scale goes from ``first`` on the completion's
    first tokens to ``later`` after a few; the sampler rounds them to bf16 (and keeps the ``top_k`` largest)."""
    g = torch.Generator().manual_seed(seed)
    width, vocab = 32, 64
    scale = later + (first - later) * torch.exp(-torch.arange(width, dtype=torch.float32) / 3.0)
    trainer_logits = torch.randn(B, width, vocab, generator=g) * scale[None, :, None]
    sampler_logits = trainer_logits.bfloat16().float()
    if top_k:
        kth = sampler_logits.topk(top_k, -1).values[..., -1:]
        sampler_logits = sampler_logits.masked_fill(sampler_logits < kth, float("-inf"))
    return sampled(trainer_logits, sampler_logits, g)


def test_an_engine_whose_error_grows_on_the_first_tokens_fades_too_so_no_context_cause_is_named() -> None:
    """bf16 rounding where the first tokens' logits are larger, and top-k under bf16 where they are
    flatter, fade with no prompt difference at all: the step is unclear with what to check, not a
    context difference (nor precision or staleness)."""
    for first, later, top_k in ((2.0, 1.0, 0), (1.0, 4.0, 20)):
        for seed in range(2):
            host = host_of(scaled_logits(first, later, top_k, seed))
            sig = signature_numbers(host)
            found = diagnose(sig, n_tokens=host.totals["n_action_tokens"])
            assert sig["context_fade"] >= 1.5 and found.cause == "unclear", (first, later, top_k, seed, found.message)
            assert "so can an engine whose rounding grows" in found.message


def test_heavy_tailed_noise_on_a_small_batch_is_not_taken_for_a_fade() -> None:
    """Student-t noise (1.5 degrees of freedom) on d, the same at every position, 24 datums of 12 tokens:
    the fade's ratio passes 1.5 by chance on some steps (the first check); its z score keeps them out."""
    by_ratio = by_rule = 0
    for seed in range(100):
        torch.manual_seed(seed)
        trainer = -torch.rand(24, 12) * 3
        noise = torch.distributions.StudentT(1.5).sample((24, 12)) * 0.01
        host = host_of({"sampler_logprobs": trainer - noise, "training_logprobs": trainer, "mask": torch.ones(24, 12)})
        sig = signature_numbers(host)
        by_ratio += sig["context_fade"] >= 1.5
        by_rule += "context_fade" in diagnose(sig, n_tokens=24 * 12).numbers
    assert by_ratio >= 5 and by_rule == 0


def test_logprobs_rounded_to_16_bits_on_both_sides_do_not_hide_a_gap_as_no_mismatch() -> None:
    """bf16 logprobs on both sides match exactly on most tokens across a real gap: that is not "none";
    both sides identical still is."""
    batch = faded_context(0.2)
    rounded = {**batch, "sampler_logprobs": batch["sampler_logprobs"].bfloat16(),
               "training_logprobs": batch["training_logprobs"].bfloat16()}
    host = host_of(rounded)
    sig = signature_numbers(host)
    assert sig["frac_d_zero"] > 0.5 and sig["both_16_bit_share"] == 1.0  # the plain 50% rule would say none
    assert diagnose(sig, n_tokens=host.totals["n_action_tokens"]).cause != "none"
    same = {**rounded, "training_logprobs": rounded["sampler_logprobs"]}
    assert diagnose(signature_numbers(host_of(same)), n_tokens=B * T).cause == "none"
    one_side = signature_numbers(host_of({**batch, "sampler_logprobs": batch["sampler_logprobs"].bfloat16()}))
    assert one_side["both_16_bit_share"] == 0.0
