"""TinyCausalLM: shapes, causality (so right padding is safe), and token_logprobs."""

from __future__ import annotations

import pytest
import torch

from loops_callbacks.demo.model import TinyCausalLM, token_logprobs


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
    with pytest.raises(ValueError, match="d_model must be a positive int, got 0"):
        TinyCausalLM(vocab_size=10, d_model=0)
    with pytest.raises(ValueError, match="length 9 > max_seq_len=8"):
        TinyCausalLM(vocab_size=10, d_model=8, n_heads=2, max_seq_len=8)(torch.zeros(1, 9, dtype=torch.long))
