"""Seeded sampler faults for the RL demo: each leaves its own signature in the logprobs.

``RLPolicyModule`` takes these as options so that each cause the divergence diagnosis names
(``loops_callbacks.divergence.diagnosis``) can be produced on purpose and seen in the logs:

==========================  ==========================================================================
option                      what the sampler does wrong
==========================  ==========================================================================
``sampler_temperature=T``   samples from, and reports logprobs of, softmax(logits / T); the trainer scores at T = 1
``sampler_top_k=k``         keeps the k most likely tokens, renormalized (logprobs of the truncated distribution)
``sampler_top_p=p``         keeps the smallest set of most likely tokens with mass >= p, renormalized
``logprob_shift=±1``        reports the logprob of position k ± 1 at position k (an off-by-one in the alignment)
``sampler_prompt``          sees another template: ``"pad_as_bos"`` (first token ``<pad>``) or ``"no_bos"``
==========================  ==========================================================================

(``sync_every`` and ``sampler_precision`` of ``RLPolicyModule`` give stale weights and precision.)
With the defaults nothing changes: the sampler's draws and logprobs are the unfaulted ones, bit
for bit.

Examples:
    >>> import torch
    >>> faults = SamplerFaults(top_k=2)
    >>> faults.sampling_logprobs(torch.tensor([[0.0, 1.0, 2.0]])).exp()
    tensor([[0.0000, 0.2689, 0.7311]])
    >>> SamplerFaults(logprob_shift=1).shift(torch.tensor([[1.0, 2.0, 3.0]]))
    tensor([[2., 3., 0.]])
    >>> SamplerFaults(prompt="pad_as_bos").perturb(torch.tensor([[1, 5, 6]]), pad_id=0)
    tensor([[0, 5, 6]])
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Literal

import torch

from loops_callbacks.validation import check, check_choice, check_int


@dataclass(frozen=True)
class SamplerFaults:
    """What the sampler does differently from the trainer; the defaults: nothing."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    logprob_shift: int = 0
    prompt: Literal["same", "pad_as_bos", "no_bos"] = "same"

    def __post_init__(self) -> None:
        check("sampler_temperature", self.temperature, numbers.Real, "a number > 0", lambda t: t > 0)
        check_int("sampler_top_k", self.top_k, least=1, optional=True)
        check("sampler_top_p", self.top_p, numbers.Real, "a number in (0, 1]", lambda p: 0 < p <= 1, optional=True)
        check("logprob_shift", self.logprob_shift, int, "-1, 0 or 1", lambda shift: abs(shift) <= 1)
        check_choice("sampler_prompt", self.prompt, ("same", "pad_as_bos", "no_bos"))

    @property
    def changes_sampling(self) -> bool:
        """Whether the sampling distribution differs from softmax(logits)."""
        return self.temperature != 1.0 or self.top_k is not None or self.top_p is not None

    def sampling_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 log-probabilities ``[..., V]`` of the distribution the sampler draws from (-inf off its support)."""
        scaled = logits.float() / self.temperature if self.temperature != 1.0 else logits.float()
        if self.top_k is not None and self.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
            outside = (torch.cumsum(probs, dim=-1) - probs) >= self.top_p  # the mass before it already reaches p
            scaled = scaled.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
        return torch.log_softmax(scaled, dim=-1)

    def perturb(self, ids: torch.Tensor, *, pad_id: int) -> torch.Tensor:
        """The ids ``[B, T]`` as the sampler sees them (``prompt``): unchanged, first id ``pad_id``, or without it."""
        if self.prompt == "pad_as_bos":
            return torch.cat([torch.full_like(ids[:, :1], pad_id), ids[:, 1:]], dim=1)
        if self.prompt == "no_bos":
            return ids[:, 1:]
        return ids

    def shift(self, logprobs: torch.Tensor) -> torch.Tensor:
        """``logprobs [B, T]`` reported one position off (``logprob_shift``), 0.0 where nothing shifts in."""
        if self.logprob_shift == 0:
            return logprobs
        shifted = logprobs.roll(-self.logprob_shift, dims=1)
        shifted[:, -1 if self.logprob_shift > 0 else 0] = 0.0  # the value rolled around: nothing shifts in
        return shifted
