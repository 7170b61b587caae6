"""The output-head path: target logprobs from hidden states in row chunks, equal to the general path.

Tiny random Hugging Face models built from configs in code (no downloads): GPT-2 (tied head),
Llama, Qwen2 and Gemma 2 (final logit soft-capping), right-padded batches of different lengths.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.heads import LogitTransform, find_output_head, head_logprobs
from loops_callbacks.reference.scorer import OutputHeadWarning, TokenScorer, default_tokens_per_batch

transformers = pytest.importorskip("transformers", reason="the architectures come from transformers")

VOCAB = 96


def tiny(architecture: str) -> nn.Module:
    torch.manual_seed(0)
    common: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    if architecture == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        return transformers.GPT2LMHeadModel(config).eval()
    llama_like = {**common, "intermediate_size": 64, "num_key_value_heads": 2, "max_position_embeddings": 64}
    if architecture == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like)).eval()
    if architecture == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like, tie_word_embeddings=False)).eval()
    if architecture == "gemma2":
        # a small soft-cap, so that leaving it out would change the values a lot
        config = transformers.Gemma2Config(**llama_like, head_dim=8, final_logit_softcapping=0.5)
        return transformers.Gemma2ForCausalLM(config).eval()
    raise AssertionError(architecture)


PROMPTS = [list(range(3, 40)), [5, 9], [7, 1, 95, 0, 12, 44], [2] * 21, [8], list(range(90, 60, -1))]


def values(client: TorchSamplingClient) -> list[list[float | None]]:
    return client.compute_logprobs_batch(PROMPTS)


def max_diff(a: list[list[float | None]], b: list[list[float | None]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra[1:], rb[1:]))


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "qwen2", "gemma2"])
def test_output_head_path_equals_the_general_path(architecture: str) -> None:
    model = tiny(architecture)
    head = TorchSamplingClient(model, max_tokens_per_batch=64)  # several right-padded batches
    general = TorchSamplingClient(model, max_tokens_per_batch=64, output_head=False)
    got, want = values(head), values(general)
    assert head.path == "output_head", head.why_not_head
    assert general.path == "logits"
    assert max_diff(got, want) <= 1e-5
    # the model's own logits were never made: during scoring the head returns a [B, T, 1] placeholder
    shapes: list[tuple[int, ...]] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    try:
        head.compute_logprobs_batch(PROMPTS)
    finally:
        hook.remove()
    assert shapes and all(shape[-1] == 1 for shape in shapes)


def test_gemma2_soft_capping_matters_and_is_applied() -> None:
    model = tiny("gemma2")
    found, why = find_output_head(model)
    assert found is not None and found.transform == LogitTransform(softcap=0.5), why
    found.transform = LogitTransform()  # what leaving the soft-cap out would give
    client = TorchSamplingClient(model)
    client.head = found
    client._verified = True
    uncapped = values(client)
    assert max_diff(uncapped, values(TorchSamplingClient(model, output_head=False))) > 1e-3  # 100x the tolerance


def test_small_chunks_give_the_same_values() -> None:
    model = tiny("llama")
    one_row = TorchSamplingClient(model)
    one_row.head_rows = 1
    assert max_diff(values(one_row), values(TorchSamplingClient(model))) <= 1e-5


def test_unknown_transforms_take_the_general_path() -> None:
    # Granite divides its logits by logits_scaling: not applied here, so never the head path
    torch.manual_seed(0)
    config = transformers.GraniteConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        logits_scaling=4.0,
    )
    granite = TorchSamplingClient(transformers.GraniteForCausalLM(config).eval())
    assert granite.path == "logits" and "logits_scaling" in granite.why_not_head
    with pytest.warns(OutputHeadWarning, match="GraniteForCausalLM is scored from its full logits.*logits_scaling"):
        values(granite)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutputHeadWarning)
        values(granite)  # once per scorer

    class Scaled(nn.Module):
        """A head whose output the model changes afterwards: only the one-time check can tell."""

        def __init__(self) -> None:
            super().__init__()
            self.embed, self.lm_head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.embed(input_ids)) * 3.0

    model = Scaled()
    client = TorchSamplingClient(model)
    with pytest.warns(OutputHeadWarning, match="Scaled is scored from its full logits.*relative difference"):
        got = values(client)
    assert client.path == "logits" and "relative difference" in client.why_not_head
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutputHeadWarning)  # the general path asked for, or no head: nothing to say
        assert max_diff(got, values(TorchSamplingClient(model, output_head=False))) == 0.0
        values(TorchSamplingClient(nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))))


def test_head_logprobs_by_hand_with_a_transform() -> None:
    torch.manual_seed(1)
    hidden, weight = torch.randn(7, 5, dtype=torch.float64), torch.randn(13, 5, dtype=torch.float64)
    targets = torch.randint(0, 13, (7,))
    transform = LogitTransform(scale=0.5, softcap=2.0)
    got = head_logprobs(hidden, targets, weight, None, transform, rows_per_chunk=3)
    logits = torch.tanh(hidden @ weight.T * 0.5 / 2.0) * 2.0
    want = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-6)


def test_the_default_budget_does_not_depend_on_the_vocabulary_on_the_head_path() -> None:
    big_vocab = 200_000
    general = default_tokens_per_batch("cuda", big_vocab)
    assert general < 16384
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=big_vocab, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    assert TorchSamplingClient(model, device="cpu").max_tokens_per_batch == 2048
    # on CUDA (nothing runs here: the budget is known before any batch)
    assert TokenScorer(model, module=model, device="cuda").max_tokens_per_batch == 16384
    assert TokenScorer(model, module=model, device="cuda", output_head=False, vocab_size=big_vocab).max_tokens_per_batch == general
