"""``token_logprobs``: the one target-token log-probability, what each path computed before and closer to float64.

The implementations it replaced are kept verbatim in ``tests/logprobs_before.py`` (each a fused
``log_softmax``); every path is compared with them (values, and gradients where there are some) in
float32, bfloat16, float16 and float64: equal within the old route's rounding, and never further from
a float64 computation of the same logits (``_no_further_from_float64``). The float32 fused
``log_softmax`` of the CPU kernels is biased by about 1e-5 per token; the target's logit minus the
logsumexp (TRL's route) is not.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import loops_callbacks
from loops_callbacks.demo.dpo import DPOPolicyModule
from loops_callbacks.demo.model import TinyCausalLM
from loops_callbacks.demo.model import token_logprobs as demo_token_logprobs
from loops_callbacks.logprobs import token_logprobs
from loops_callbacks.reference.heads import LogitTransform, head_logprobs
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.reference.scorer import TokenScorer
from tests.logprobs_before import demo_before, head_before, policy_before, reference_before

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=generator, dtype=torch.float64) * 4).to(dtype)
    return logits, torch.randint(0, shape[-1], shape[:-1], generator=generator)


# ---------------------------------------------------------------- the public function


def test_it_is_public_and_documented() -> None:
    assert loops_callbacks.token_logprobs is token_logprobs and "token_logprobs" in loops_callbacks.__all__
    assert demo_token_logprobs is token_logprobs  # the demo re-exports the same function
    assert ">>>" in (token_logprobs.__doc__ or "")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_of_the_result(dtype: torch.dtype) -> None:
    logits, targets = _logits((2, 3, 7), dtype)
    assert token_logprobs(logits, targets).dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert token_logprobs(logits, targets, dtype=torch.float32).dtype == torch.float32


def test_a_model_output_with_logits_is_read() -> None:
    logits, targets = _logits((2, 4, 9), torch.float32)
    assert torch.equal(token_logprobs(SimpleNamespace(logits=logits), targets), token_logprobs(logits, targets))


def test_chunks_do_not_change_the_values() -> None:
    logits, targets = _logits((5, 4, 11), torch.bfloat16)
    whole = token_logprobs(logits, targets, rows_per_chunk=5)
    for rows in (1, 2, 3, 100):
        assert torch.equal(token_logprobs(logits, targets, rows_per_chunk=rows), whole)


def test_bad_arguments_are_named() -> None:
    logits, targets = _logits((2, 3, 5), torch.float32)
    with pytest.raises(ValueError, match=r"logits \[2, 3, 5\] and target_tokens \[2, 2\]"):
        token_logprobs(logits, targets[:, :2])
    with pytest.raises(ValueError, match=r"logits \[5\]"):
        token_logprobs(logits[0, 0], targets[0, 0])
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.float32"):
        token_logprobs(logits, targets.float())
    with pytest.raises(TypeError, match="target_tokens must be a tensor.*list"):
        token_logprobs(logits, targets.tolist())
    with pytest.raises(TypeError, match="logits must be floating point"):
        token_logprobs(targets[..., None], targets)
    with pytest.raises(TypeError, match="with .logits, got dict"):
        token_logprobs({"logits": logits}, targets)
    with pytest.raises(ValueError, match="rows_per_chunk must be an int >= 1 or None, got 0"):
        token_logprobs(logits, targets, rows_per_chunk=0)
    assert logits.dtype == torch.float32 and targets.dtype == torch.int64  # the caller's tensors are untouched


@pytest.mark.parametrize(("value", "said"), [
    (-100, r"target_tokens holds -100 \(Hugging Face's ignore index\) at 2 positions, first \[0, 1\]; .*mask"),
    (-1, r"target_tokens holds -1 at 2 positions, first \[0, 1\]; token ids are in \[0, 5\)"),
    (5, r"target_tokens holds 5 at 2 positions, first \[0, 1\]; token ids are in \[0, 5\)"),
])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [None, 1])
def test_a_target_outside_the_vocabulary_is_named(value: int, said: str, with_entropy: bool,
                                                  rows_per_chunk: int | None) -> None:
    logits, targets = _logits((2, 3, 5), torch.float32)
    targets[0, 1] = targets[1, 2] = value
    given = targets.clone()
    with pytest.raises(ValueError, match=said):
        token_logprobs(logits, targets, with_entropy=with_entropy, rows_per_chunk=rows_per_chunk)
    assert torch.equal(targets, given)  # the caller's ids are not modified
    logits.requires_grad_(True)
    with pytest.raises(ValueError, match=said):  # under autograd too
        token_logprobs(logits, targets)


# ---------------------------------------------------------------- each old path's numbers, closer to float64

ROUNDING = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 1e-4, torch.float16: 1e-4}
"""How far the old fused log_softmax may sit from the new route (float32 rounding of a 32,768-way sum)."""


def _exact(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The target logprobs of these logits (as given, in their dtype) computed in float64."""
    return torch.log_softmax(logits.detach().double(), -1).gather(-1, targets.long()[..., None])[..., 0]


def _no_further_from_float64(new: torch.Tensor, old: torch.Tensor, exact: torch.Tensor) -> None:
    """``new`` is ``old`` within rounding, and its mean error against ``exact`` no larger than ``old``'s but for
    float32 rounding (a small vocabulary's normalizer has no bias to remove)."""
    finite = exact.isfinite()
    assert torch.equal(new.isfinite(), finite) and torch.equal(old.isfinite(), finite)
    new, old, exact = new.detach().double()[finite], old.detach().double()[finite], exact[finite]
    torch.testing.assert_close(new, old, rtol=0, atol=ROUNDING[torch.float32] if new.numel() else 0)
    assert (new - exact).abs().mean() <= (old - exact).abs().mean() + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_policy_path_is_unchanged_values_and_gradients(dtype: torch.dtype) -> None:
    logits, targets = _logits((4, 6, 13), dtype)
    new_leaf, old_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    new, old = token_logprobs(new_leaf, targets), policy_before(old_leaf, targets)
    assert new.dtype == old.dtype
    _no_further_from_float64(new, old, _exact(logits, targets))
    weights = torch.linspace(-1, 1, new.numel(), dtype=new.dtype).view_as(new)
    (new * weights).sum().backward()
    (old * weights).sum().backward()
    torch.testing.assert_close(new_leaf.grad, old_leaf.grad, rtol=0, atol=ROUNDING[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_demo_path_is_unchanged_values_and_gradients(dtype: torch.dtype) -> None:
    logits, targets = _logits((3, 5, 14), dtype, seed=1)
    logits[0, 0, :4] = float("-inf")  # a truncated sampler distribution (top-k / top-p faults)
    new_leaf, old_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    new, old = token_logprobs(new_leaf, targets), demo_before(old_leaf, targets)
    assert new.dtype == old.dtype
    _no_further_from_float64(new, old, _exact(logits, targets))
    new.masked_fill(~new.isfinite(), 0).sum().backward()
    old.masked_fill(~old.isfinite(), 0).sum().backward()
    torch.testing.assert_close(new_leaf.grad, old_leaf.grad, rtol=0, atol=ROUNDING[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_general_path_is_unchanged(dtype: torch.dtype) -> None:
    # 5 rows of 40 x 32768 logits: more than the 16 MiB chunk, so both split the rows the same way
    logits, targets = _logits((5, 41, 32768), dtype, seed=2)
    logits = logits[:, :-1]  # the scorer's slice: not contiguous
    targets = targets[:, 1:]
    with torch.inference_mode():
        new = token_logprobs(logits, targets, dtype=torch.float32)
        old = reference_before(logits, targets)
    assert new.dtype == old.dtype == torch.float32
    _no_further_from_float64(new, old, _exact(logits, targets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_vocabulary_loses_no_bias_to_a_fused_log_softmax(dtype: torch.dtype) -> None:
    """On a real vocabulary (49,152, SmolLM2's) the fused float32 log_softmax of the CPU kernels reads every
    token about 1e-5 high or low, always the same way; the logsumexp route is unbiased to float32 rounding."""
    logits, targets = _logits((2, 16, 49152), dtype, seed=9)
    exact = _exact(logits, targets)
    new_bias = (token_logprobs(logits, targets).double() - exact).mean().abs()
    old_bias = (policy_before(logits, targets).double() - exact).mean().abs()
    assert new_bias < 1e-6 and new_bias < old_bias / 4, (new_bias, old_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_scorer_general_path_gives_what_it_gave_before(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    model = TinyCausalLM(vocab_size=50, d_model=16, n_layers=1, n_heads=2, max_seq_len=16).to(dtype)
    ids = torch.randint(0, 50, (3, 12))
    scorer = TokenScorer(model, module=model, device="cpu", output_head=False, max_tokens_per_batch=64)
    got = scorer.score_packed(PackedTokens.from_sequences(ids.tolist())).view(3, 12)[:, :-1]
    with torch.inference_mode():
        logits = model(ids)[:, :-1]
        want = reference_before(logits, ids[:, 1:])
    assert scorer.path == "logits"
    _no_further_from_float64(got, want, _exact(logits, ids[:, 1:]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=2.0)])
def test_the_output_head_path_is_unchanged(dtype: torch.dtype, transform: LogitTransform) -> None:
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(23, 8, generator=generator).to(dtype)
    weight, bias = torch.randn(37, 8, generator=generator).to(dtype), torch.randn(37, generator=generator).to(dtype)
    targets = torch.randint(0, 37, (23,), generator=generator)
    with torch.inference_mode():
        new = head_logprobs(hidden, targets, weight, bias, transform, rows_per_chunk=5)
        old = head_before(hidden, targets, weight, bias, transform, rows_per_chunk=5)
        logits = torch.nn.functional.linear(hidden, weight, bias)
        logits = logits if transform.scale is None and transform.softcap is None else transform(logits.float())
    _no_further_from_float64(new, old, _exact(logits, targets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_dpo_policy_module_gives_what_it_gave_before(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    module = DPOPolicyModule(vocab_size=20, d_model=16, n_layers=1, n_heads=2, max_seq_len=16).to(dtype)
    ids = torch.randint(0, 20, (4, 9))
    batch = {"input_ids": ids, "target_tokens": torch.cat([ids[:, 1:], ids.new_zeros(4, 1)], dim=1)}
    got = module.policy_logprobs(batch)
    logits = module(ids)
    want = policy_before(logits, batch["target_tokens"])
    assert got.requires_grad
    _no_further_from_float64(got, want, _exact(logits, batch["target_tokens"]))
    with torch.no_grad():  # validation: no autograd, the same numbers
        assert torch.equal(module.policy_logprobs(batch), got.detach())


def test_a_hugging_face_output_is_read_like_its_logits() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(6)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 40, (2, 7))
    output = model(input_ids=ids[:, :-1])
    assert torch.equal(token_logprobs(output, ids[:, 1:]), token_logprobs(output.logits, ids[:, 1:]))


def test_the_head_and_logits_paths_share_the_formula_on_a_model() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.lm_head = nn.Embedding(30, 8), nn.Linear(8, 30)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.embed(input_ids))

    torch.manual_seed(7)
    model = LM()
    packed = PackedTokens.from_sequences(torch.randint(0, 30, (4, 10)).tolist())
    head = TokenScorer(model, module=model, device="cpu", head_rows=3)
    general = TokenScorer(model, module=model, device="cpu", output_head=False)
    got, want = head.score_packed(packed), general.score_packed(packed)
    assert head.path == "output_head" and general.path == "logits"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_entropy_and_varentropy_are_those_of_each_positions_distribution() -> None:
    """H = -sum p log p and V = sum p (log p + H)^2 of the same float32 log-softmax, whatever the chunking;
    a token of probability 0 adds nothing; the logprobs stay differentiable and equal to the plain call's."""
    torch.manual_seed(8)
    logits = (3 * torch.randn(3, 6, 50)).requires_grad_()
    logits_with_a_zero = logits.detach().clone()
    logits_with_a_zero[..., 0] = float("-inf")
    targets = torch.randint(1, 50, (3, 6))
    out = token_logprobs(logits, targets, with_entropy=True)
    reference = torch.log_softmax(logits.detach().double(), -1)
    p = reference.exp()
    entropy = -(p * reference).sum(-1)
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.varentropy.double(), (p * (reference + entropy[..., None]) ** 2).sum(-1),
                               rtol=0, atol=1e-4)
    assert out.logprobs.requires_grad and not out.entropy.requires_grad
    assert torch.equal(out.logprobs, token_logprobs(logits, targets))
    with torch.no_grad():
        chunked = token_logprobs(logits, targets, with_entropy=True, rows_per_chunk=1)
    assert all(torch.equal(a, b) for a, b in zip(chunked, out))
    zero = token_logprobs(logits_with_a_zero, targets, with_entropy=True)
    assert bool(zero.entropy.isfinite().all() and zero.varentropy.isfinite().all())
    with pytest.raises(TypeError, match="with_entropy"):
        token_logprobs(logits, targets, with_entropy="yes")


def test_the_gradient_is_that_of_the_formula() -> None:
    """The one-pass backward (``g * (onehot(target) - softmax)``) against finite differences, in float64."""
    logits, targets = _logits((2, 3, 7), torch.float64, seed=10)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets), (logits.requires_grad_(),))
