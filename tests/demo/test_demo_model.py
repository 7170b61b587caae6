"""TinyCausalLM: shapes, causality (so right padding is safe), token_logprobs, the KV cache, and
bf16 numerics computed in float32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from loops_callbacks.demo.model import KVCache, TinyCausalLM, _Numerics, token_logprobs


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(vocab_size=14, d_model=32, n_layers=2, n_heads=4, max_seq_len=16).eval()


def test_forward_shape_and_near_uniform_start() -> None:
    model = _model()
    logits = model(torch.randint(0, 14, (3, 9)))
    assert logits.shape == (3, 9, 14) and logits.dtype == torch.float32
    # small init: the untrained model is close to uniform, so RL starts from exploration
    probs = logits.softmax(-1)
    assert 0.5 / 14 < probs.min() and probs.max() < 2 / 14


def test_changing_a_later_token_leaves_earlier_logits_unchanged() -> None:
    model = _model()
    input_ids = torch.randint(0, 14, (2, 12))
    before = model(input_ids)
    for position in (0, 5, 11):
        changed = input_ids.clone()
        changed[:, position] = (changed[:, position] + 1) % 14
        after = model(changed)
        torch.testing.assert_close(after[:, :position], before[:, :position], rtol=0, atol=1e-6)
        assert (after[:, position] - before[:, position]).abs().max() > 1e-4


def test_right_padding_does_not_change_real_positions() -> None:
    model = _model()
    tokens = torch.tensor([[1, 4, 5, 6, 13]])
    padded = torch.cat([tokens, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded)[:, :5], model(tokens), rtol=0, atol=1e-6)


def test_token_logprobs_matches_log_softmax_gather() -> None:
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32
    expected = logits.float().log_softmax(-1)
    for b in range(2):
        for k in range(3):
            assert out[b, k].item() == pytest.approx(expected[b, k, targets[b, k]].item(), abs=1e-6)
    with pytest.raises(ValueError, match="share"):
        token_logprobs(logits, targets[:, :2])


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="n_heads=3"):
        TinyCausalLM(vocab_size=10, d_model=32, n_heads=3)
    with pytest.raises(ValueError, match="d_model must be an int >= 1, got 0"):
        TinyCausalLM(vocab_size=10, d_model=0)
    with pytest.raises(ValueError, match="length 9 > max_seq_len=8"):
        TinyCausalLM(vocab_size=10, d_model=8, n_heads=2, max_seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def _peaked(seed: int = 0) -> TinyCausalLM:
    """A model with large random weights: peaked distributions, where bf16 rounding shows."""
    torch.manual_seed(seed)
    model = TinyCausalLM(vocab_size=14, d_model=64, n_layers=2, n_heads=4, max_seq_len=12).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model


def _bf16(model: TinyCausalLM, compute_dtype: torch.dtype | None) -> TinyCausalLM:
    low = copy.deepcopy(model).to(torch.bfloat16)
    low.compute_dtype = compute_dtype
    return low


def test_kv_cache_continues_the_sequence_like_a_full_forward() -> None:
    model = _peaked()
    input_ids = torch.randint(0, 14, (6, 11))
    for variant, atol in ((model, 1e-5), (_bf16(model, torch.float32), 0.0)):
        full = variant(input_ids)
        cache = KVCache()
        pieces = [variant(input_ids[:, :5], cache=cache)]
        pieces += [variant(input_ids[:, k : k + 1], cache=cache) for k in range(5, 9)]
        pieces.append(variant(input_ids[:, 9:], cache=cache))  # two tokens at once after the cache
        assert cache.length == 11
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=atol)
    with pytest.raises(ValueError, match="length 13 > max_seq_len=12"):
        model(input_ids[:, :2], cache=cache)


def test_shared_prompt_cache_equals_repeated_prompts() -> None:
    model = _bf16(_peaked(), torch.float32)
    prompts, continuation = torch.randint(0, 14, (3, 6)), torch.randint(0, 14, (6, 1))
    shared, repeated = KVCache(), KVCache()
    model(prompts, cache=shared)
    shared.repeat_interleave(2)
    model(prompts.repeat_interleave(2, dim=0), cache=repeated)
    torch.testing.assert_close(model(continuation, cache=shared), model(continuation, cache=repeated), rtol=0, atol=0)


def _one_bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The gap between neighbouring bf16 values at ``|x|`` (``eps * 2**floor(log2|x|)``), per element."""
    return torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))))


def _flash_attention_in_float32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for bf16 inputs, computed by the emulation in float32."""
    assert is_causal
    return _Numerics(torch.bfloat16, torch.float32).attention(q.float(), k.float(), v.float()).to(q.dtype)


def test_each_float32_kernel_is_its_native_bf16_kernel_up_to_float32_rounding() -> None:
    torch.manual_seed(0)
    numerics = _Numerics(torch.bfloat16, torch.float32)
    block = _bf16(_peaked(), None).blocks[0]
    x = torch.randn(64, 11, 64).bfloat16()
    q, k, v = (torch.randn(64, 4, 11, 16).mul(2).bfloat16() for _ in range(3))
    eps = torch.finfo(torch.bfloat16).eps
    kernels = {  # name: (float32 kernels with bf16 rounding, the native bf16 kernel, on the same bf16 inputs,
        # what a one-step move of an inner rounding can add)
        "linear": (numerics.linear(block.qkv, x.float()), block.qkv(x), 0.0),
        "layer norm": (numerics.layer_norm(block.attn_norm, x.float()), block.attn_norm(x), 0.0),
        "gelu": (numerics.round(F.gelu(x.float())), F.gelu(x), 0.0),
        # the bf16 probabilities: one step of each (<= eps * p) moves the output by <= eps * max |v|
        "attention": (
            numerics.attention(q.float(), k.float(), v.float()),
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            eps * v.float().abs().amax(2, True),
        ),
    }
    for name, (emulated, native, inner) in kernels.items():
        native = native.float()
        # Both accumulate in float32, so they round the same float32 value up to the kernels' own
        # float32 arithmetic (the order of their sums, their exp), which differs between CPUs' kernels.
        # That moves a rounding to a neighbouring bf16 value, only where a value sits within float32
        # error of a rounding boundary: at most 1% of the outputs here (AVX2's attention), under 0.02%
        # elsewhere; a missing or extra rounding differs on far more (attention without its bf16
        # probabilities: 11%).
        step = torch.maximum(_one_bf16_step(emulated), _one_bf16_step(native))
        assert bool(((emulated - native).abs() <= step + inner).all()), name
        assert (emulated != native).float().mean() < 0.03, name


def test_float32_compute_with_bf16_weights_is_native_bf16_up_to_summation_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _peaked()
    input_ids = torch.randint(0, 14, (64, 12))
    exact = token_logprobs(model(input_ids[:, :-1]), input_ids[:, 1:])
    native_logits = _bf16(model, None)(input_ids[:, :-1])
    emulated_logits = _bf16(model, torch.float32)(input_ids[:, :-1])
    assert native_logits.dtype == torch.bfloat16 and emulated_logits.dtype == torch.float32
    # every stored value is a bf16 value
    assert torch.equal(emulated_logits, emulated_logits.bfloat16().float())
    native = token_logprobs(native_logits, input_ids[:, 1:])
    emulated = token_logprobs(emulated_logits, input_ids[:, 1:])
    precision_gap = (native - exact).abs().mean()
    assert precision_gap > 1e-3  # the bf16 rounding is real, and the emulation's is as large
    emulated_gap = (emulated - exact).abs().mean().item()
    assert emulated_gap == pytest.approx(precision_gap.item(), rel=0.1)  # 0.97-1.04 times (seeds, CPUs)
    # without the rounding (float32 weights and activations) there would be no gap at all
    unrounded = copy.deepcopy(model)
    unrounded.compute_dtype = torch.float32
    torch.testing.assert_close(token_logprobs(unrounded(input_ids[:, :-1]), input_ids[:, 1:]), exact, rtol=0, atol=0)
    # Bit for bit, the native logits follow the CPU's attention kernel: one bf16 step on ~1% of its
    # outputs with ATen's AVX2 kernels (test above) compounds to a third of the logits after two
    # layers. With native attention computed as the emulation computes it, the rest of the native
    # forward (embeddings, linear layers, layer norms, GELU, residual adds) is the emulation's up to
    # summation order: almost all logits bit for bit, and mean |emulated - native| a small share of
    # the gap (1/68 to 1/270 on an Intel Xeon with ATen's AVX2, AVX-512 or scalar kernels); ~1 without rounding.
    monkeypatch.setattr(F, "scaled_dot_product_attention", _flash_attention_in_float32)
    pinned_logits = _bf16(model, None)(input_ids[:, :-1])
    assert (emulated_logits != pinned_logits.float()).float().mean() < 0.01
    assert (emulated - token_logprobs(pinned_logits, input_ids[:, 1:])).abs().mean() < precision_gap / 25
