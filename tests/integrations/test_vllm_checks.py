"""What the vLLM integration refuses, against engine doubles (whether vLLM is installed or not): reference values
that are not logprobs or are missing, and pushes that would leave the engine's weights unknown."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace as Fake
from typing import Any

import pytest
import torch

from loops_callbacks.integrations.vllm import VLLMSamplingClient
from loops_callbacks.reference.packing import PackedTokens


@pytest.fixture
def vllm_stub(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in ``vllm`` module, so the engine doubles work whether vLLM is installed or not."""
    stub = types.ModuleType("vllm")
    stub.SamplingParams = lambda **kwargs: Fake(**kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", stub)
    return stub


def config(dtype: torch.dtype = torch.float32) -> Fake:
    return Fake(model_config=Fake(dtype=dtype, logprobs_mode="raw_logprobs", get_vocab_size=lambda: 16),
                cache_config=Fake(enable_prefix_caching=False), scheduler_config=Fake(max_num_batched_tokens=2048))


class ScoringLLM:
    """A vllm.LLM double answering prompt logprobs: -0.5 per token, ``bad`` at position 2 of a 4-token prompt,
    ``drop`` outputs left out."""

    def __init__(self, bad: float | None = None, drop: int = 0) -> None:
        self.llm_engine = Fake(vllm_config=config())
        self.bad, self.drop = bad, drop

    def generate(self, requests: list[dict[str, Any]], params: Any, use_tqdm: bool = False) -> list[Fake]:
        outputs = []
        for request in requests:
            ids = request["prompt_token_ids"]
            values = [-0.5] * len(ids)
            if self.bad is not None and len(ids) == 4:
                values[2] = self.bad
            outputs.append(Fake(prompt_logprobs=[None] + [{t: Fake(logprob=v)} for t, v in zip(ids[1:], values[1:])]))
        return outputs[: len(outputs) - self.drop]


SEQUENCES = [[1, 2, 3], [4, 5, 6, 7], [9], [2, 3]]


def client(llm: ScoringLLM) -> VLLMSamplingClient:
    return VLLMSamplingClient(llm)  # prefix caching off: no warning


def test_the_double_scores_as_the_engine_does(vllm_stub: Any) -> None:
    values = client(ScoringLLM()).score_packed(PackedTokens.from_sequences(SEQUENCES))
    assert values.tolist() == [-0.5, -0.5, 0.0, -0.5, -0.5, -0.5, 0.0, 0.0, -0.5, 0.0]


@pytest.mark.parametrize("drop", [1, 3])
def test_fewer_outputs_than_prompts_is_an_error_not_zeros(vllm_stub: Any, drop: int) -> None:
    reference = client(ScoringLLM(drop=drop))
    with pytest.raises(ValueError, match=rf"vLLM returned {3 - drop} outputs for 3 prompts"):
        reference.score_packed(PackedTokens.from_sequences(SEQUENCES))
    with pytest.raises(ValueError, match=rf"vLLM returned {3 - drop} outputs for 3 prompts"):
        reference.compute_logprobs_batch(SEQUENCES)


@pytest.mark.parametrize("bad", [math.nan, 0.3, math.inf])
def test_an_engine_value_that_is_no_logprob_names_the_datum_and_position(vllm_stub: Any, bad: float) -> None:
    reference = client(ScoringLLM(bad=bad))
    with pytest.raises(ValueError, match=rf"vLLM's prompt logprobs: datum 1, position 1 is {bad:g}, not a logprob"):
        reference.score_packed(PackedTokens.from_sequences(SEQUENCES))
    with pytest.raises(ValueError, match=rf"datum 1, position 1 is {bad:g}"):
        reference.compute_logprobs_batch(SEQUENCES)


def test_a_prompt_that_is_not_1d_names_itself(vllm_stub: Any) -> None:
    with pytest.raises(ValueError, match=r"prompt 0: expected a 1-D sequence of token ids, got a Tensor of shape"):
        client(ScoringLLM()).compute_logprobs(torch.tensor([[1, 2, 3]]))
