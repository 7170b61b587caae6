"""``TorchSamplingClient``: batched scoring equals a hand-computed log-softmax, in the caller's order."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient
from loops_callbacks.types import ModelInput

VOCAB = 23


class TinyCausalLM(nn.Module):
    """One causal self-attention block with learned positions: context matters, padding must not."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, max_len: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, vocab)
        self.calls: list[tuple[int, int]] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(input_ids.shape))
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.drop(x))


def make_model(seed: int = 0, **kwargs: Any) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(**kwargs)


def by_hand(model: nn.Module, tokens: list[int]) -> list[float | None]:
    """log p(token i | tokens before i), from the model run on this sequence alone, in float64."""
    if len(tokens) < 2:
        return [None] * len(tokens)
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
        logits = (out.logits if hasattr(out, "logits") else out)[0].double()
    logprobs = logits.log_softmax(-1)
    return [None] + [logprobs[i - 1, tokens[i]].item() for i in range(1, len(tokens))]


def assert_close(got: list[float | None], want: list[float | None], atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    assert (got[0] if got else None) is None
    assert all((g is None) == (w is None) for g, w in zip(got, want))
    assert max((abs(g - w) for g, w in zip(got, want) if g is not None), default=0.0) <= atol, (got, want)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [5], [], [7, 7], list(range(20)), [2, 22, 0, 11, 8], [9] * 13]


def test_matches_hand_computed_log_softmax_in_callers_order() -> None:
    model = make_model()
    client = TorchSamplingClient(model, max_tokens_per_batch=40)
    got = client.compute_logprobs_batch([ModelInput.from_ints(t) for t in PROMPTS])
    assert [len(g) for g in got] == [len(t) for t in PROMPTS]
    assert got[1] == [None] and got[2] == []
    for tokens, lp in zip(PROMPTS, got):
        assert_close(lp, by_hand(model, tokens))
    assert all(isinstance(v, float) for lp in got for v in lp[1:])


def test_batches_respect_the_budget_longest_first() -> None:
    model = make_model()
    client = TorchSamplingClient(model, max_tokens_per_batch=40)
    model.calls.clear()
    client.compute_logprobs_batch(PROMPTS)
    assert model.calls[0] == (2, 20)  # 20+13 padded to 2 x 20 = 40 tokens
    assert all(b * t <= 40 for b, t in model.calls)
    assert sum(b for b, _ in model.calls) == 5  # the prompts of 0 and 1 tokens need no forward


def test_budget_smaller_than_one_sequence_still_scores() -> None:
    model = make_model()
    big = TorchSamplingClient(model, max_tokens_per_batch=10_000).compute_logprobs_batch(PROMPTS)
    model.calls.clear()
    tiny = TorchSamplingClient(model, max_tokens_per_batch=1).compute_logprobs_batch(PROMPTS)
    assert all(b == 1 for b, _ in model.calls)
    for a, b in zip(big, tiny):
        assert_close(a, b)


def test_single_prompt_forms_and_protocol() -> None:
    model = make_model()
    client = TorchSamplingClient(model)
    want = by_hand(model, [1, 2, 3])
    assert_close(client.compute_logprobs(ModelInput.from_ints([1, 2, 3])), want)
    assert_close(client.compute_logprobs([1, 2, 3]), want)
    assert_close(client.compute_logprobs(torch.tensor([1, 2, 3])), want)
    assert isinstance(client, SamplingClient)


def test_tinker_model_input() -> None:
    tinker = pytest.importorskip("tinker", reason="tinker's own ModelInput")
    model = make_model()
    got = TorchSamplingClient(model).compute_logprobs(tinker.ModelInput.from_ints([4, 5, 6, 7]))
    assert_close(got, by_hand(model, [4, 5, 6, 7]))


def test_scores_in_eval_mode_and_restores_the_mode() -> None:
    model = make_model(dropout=0.5)
    model.train()
    client = TorchSamplingClient(model)
    first = client.compute_logprobs(list(range(12)))
    assert client.compute_logprobs(list(range(12))) == first  # no dropout
    assert model.training and model.drop.training
    model.eval()
    assert_close(first, by_hand(model, list(range(12))))


def test_tuple_output_and_bad_output() -> None:
    class TupleLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()

        def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
            return self.inner(input_ids), None

    model = TupleLM()
    assert_close(TorchSamplingClient(model).compute_logprobs([1, 2, 3]), by_hand(model.inner, [1, 2, 3]))

    class FlatLM(nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(input_ids.shape[0], 5)

    with pytest.raises(ValueError, match=r"shape \(1, 5\)"):
        TorchSamplingClient(FlatLM()).compute_logprobs([1, 2])


def test_hugging_face_causal_lm() -> None:
    transformers = pytest.importorskip("transformers", reason="the Hugging Face check needs transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    client = TorchSamplingClient.snapshot(model, max_tokens_per_batch=48)
    assert client.vocab_size == 64
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8], [63, 0, 12], list(range(30)), [5, 5, 5, 5]]
    model.eval()
    for tokens, lp in zip(prompts, client.compute_logprobs_batch(prompts)):
        assert_close(lp, by_hand(model, tokens))


# --- snapshot and fingerprint --------------------------------------------------------------------


def test_snapshot_is_frozen_and_independent() -> None:
    model = make_model(dropout=0.1)
    model.train()
    client = TorchSamplingClient.snapshot(model)
    assert client.model is not model
    assert not client.model.training and all(not p.requires_grad for p in client.model.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())
    before = client.compute_logprobs(list(range(10)))
    fingerprint = client.fingerprint()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert client.compute_logprobs(list(range(10))) == before
    assert client.fingerprint() == fingerprint


def test_snapshot_dtype_leaves_the_original_alone() -> None:
    model = make_model()
    client = TorchSamplingClient.snapshot(model, dtype=torch.bfloat16, device="cpu")
    assert client.dtype == torch.bfloat16 and client.device == torch.device("cpu")
    assert all(p.dtype == torch.bfloat16 for p in client.model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.eval()
    assert_close(client.compute_logprobs(list(range(15))), by_hand(model, list(range(15))), atol=0.1)
    assert TorchSamplingClient.snapshot(model, dtype="float64").dtype == torch.float64


def test_fingerprint_equal_for_equal_weights_and_changes_with_any_weight() -> None:
    a, b = TorchSamplingClient.snapshot(make_model(1)), TorchSamplingClient.snapshot(make_model(1))
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 64
    assert TorchSamplingClient.snapshot(make_model(2)).fingerprint() != a.fingerprint()
    with torch.no_grad():
        b.model.head.bias[3] += 1e-6
    assert b.fingerprint() != a.fingerprint()
    assert TorchSamplingClient.snapshot(make_model(1), dtype="float64").fingerprint() != a.fingerprint()
    half = TorchSamplingClient.snapshot(make_model(1), dtype=torch.bfloat16)
    assert half.fingerprint() == TorchSamplingClient.snapshot(make_model(1), dtype="bfloat16").fingerprint()
    assert half.fingerprint() != a.fingerprint()


def test_fingerprint_is_stable_across_processes() -> None:
    code = (
        "import torch\n"
        "from loops_callbacks.reference.clients import TorchSamplingClient\n"
        "m = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 6))\n"
        "with torch.no_grad():\n"
        "    for i, p in enumerate(m.parameters()):\n"
        "        p.copy_(torch.arange(p.numel()).reshape(p.shape) * 0.01 + i)\n"
        "print(TorchSamplingClient(m).fingerprint())\n"
    )
    here: dict[str, Any] = {}
    exec(code.replace("print(Torch", "here['fp'] = (Torch"), {"here": here})
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert there.stdout.strip() == here["fp"]


# --- vocab_size ---------------------------------------------------------------------------------


def test_vocab_size_sources() -> None:
    assert TorchSamplingClient(make_model()).vocab_size == VOCAB  # the last nn.Linear

    class WithConfig(TinyCausalLM):
        class config:  # noqa: N801
            vocab_size = 99

    assert TorchSamplingClient(WithConfig()).vocab_size == 99

    class WithHead(TinyCausalLM):
        def get_output_embeddings(self) -> nn.Module:
            return nn.Linear(2, 77)

    assert TorchSamplingClient(WithHead()).vocab_size == 77

    class WithAttribute(nn.Module):
        vocab_size = 31

    assert TorchSamplingClient(WithAttribute()).vocab_size == 31
    assert TorchSamplingClient(nn.Sequential(nn.Embedding(4, 4))).vocab_size is None


def test_token_outside_the_vocabulary_names_the_prompt() -> None:
    client = TorchSamplingClient(make_model())
    with pytest.raises(ValueError, match=f"prompt 1 has token id {VOCAB} at position 1, outside"):
        client.compute_logprobs_batch([[1, 2], [3, VOCAB]])
    with pytest.raises(ValueError, match="prompt 0 has token id -1 at position 0"):
        client.compute_logprobs([-1, 2])


# --- argument checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_tokens_per_batch": 0}, ValueError, "max_tokens_per_batch must be an int >= 1 or None, got 0"),
        ({"max_tokens_per_batch": -5}, ValueError, "max_tokens_per_batch must be an int >= 1 or None, got -5"),
        ({"max_tokens_per_batch": "512"}, TypeError, "max_tokens_per_batch must be an int >= 1 or None, got '512'"),
        ({"max_tokens_per_batch": 2.0}, TypeError, "max_tokens_per_batch must be an int >= 1 or None, got 2.0"),
        ({"dtype": "int8"}, ValueError, "dtype='int8'"),
        ({"dtype": torch.int64}, ValueError, "dtype=torch.int64"),
        ({"device": "warp-drive"}, ValueError, "device='warp-drive'"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(")):
        TorchSamplingClient(make_model(), **kwargs)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        TorchSamplingClient.snapshot(make_model(), **kwargs)


def test_model_must_be_a_module_or_a_callable() -> None:
    with pytest.raises(TypeError, match="a torch.nn.Module or a callable fn\\(input_ids\\) -> logits, got str"):
        TorchSamplingClient("gpt2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got str"):
        TorchSamplingClient.snapshot("gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot cast a plain callable"):
        TorchSamplingClient(lambda ids: ids, dtype="bfloat16")


def test_a_plain_callable_is_scored_on_the_general_path() -> None:
    model = make_model()
    client = TorchSamplingClient(lambda input_ids: model(input_ids), max_tokens_per_batch=40)
    assert client.path == "logits" and client.vocab_size is None and client.fingerprint() is None
    for tokens, lp in zip(PROMPTS, client.compute_logprobs_batch(PROMPTS)):
        assert_close(lp, by_hand(model, tokens))
    assert "max_tokens_per_batch=40" in repr(client)


def test_default_budget_by_device_type() -> None:
    client = TorchSamplingClient(make_model())
    assert client.device == torch.device("cpu") and client.max_tokens_per_batch >= 512
    assert "max_tokens_per_batch" in repr(client)


def test_resolve_reference_kinds() -> None:
    from loops_callbacks.reference.config import resolve_reference
    from loops_callbacks.reference.policy import PolicyReference

    model = make_model()
    policy = resolve_reference(None, lightning_module=model)
    assert isinstance(policy, PolicyReference) and policy.module is model  # the module itself, no copy
    assert_close(policy.compute_logprobs(list(range(9))), by_hand(model.eval(), list(range(9))))
    snapshot = resolve_reference(model)
    assert isinstance(snapshot, TorchSamplingClient) and snapshot.model is not model
    called = resolve_reference(lambda ids: model(ids))
    assert isinstance(called, TorchSamplingClient) and called.path == "logits"
    with pytest.raises(TypeError, match="a callable fn\\(input_ids\\) -> logits, a checkpoint path or None, got int"):
        resolve_reference(3)
    with pytest.raises(ValueError, match="reference=None means the LightningModule itself"):
        resolve_reference(None)
