"""DPO on the demo's tiny causal LM: a thin case of ``loops_callbacks.models.DPOModule``.

The batch layout, the loss (``dpo_loss``, re-exported here) and the logged metrics are
``DPOModule``'s (see ``loops_callbacks.models.dpo``); this module only builds the
``TinyCausalLM`` policy. ``HFDPOModule`` is the same for a Hugging Face causal LM.

Examples:
    >>> import torch
    >>> module = DPOPolicyModule(d_model=16, n_layers=1, n_heads=2)
    >>> module(torch.tensor([[1, 4, 2]])).shape[:2]  # the policy's logits [B, T, V]
    torch.Size([1, 3])
"""

from __future__ import annotations

import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from typing_extensions import override

from loops_callbacks.demo.model import TinyCausalLM
from loops_callbacks.demo.tokenizer import CharTokenizer
from loops_callbacks.models.dpo import DPOModule, dpo_loss  # noqa: F401  (the demo's DPO loss)

DEMO_VOCAB_SIZE = CharTokenizer().vocab_size
"""Vocabulary of the demo tokenizer (and of ``ReverseDigitsTask`` data): the default ``vocab_size``."""


class DPOPolicyModule(DPOModule):
    """A ``TinyCausalLM`` policy trained with DPO against precomputed reference logprobs.

    Args:
        vocab_size: token ids the model accepts (default: the demo tokenizer's).
        d_model, n_layers, n_heads, max_seq_len: size of the ``TinyCausalLM`` policy.
        beta: the DPO temperature (how far from the reference the policy may move).
        lr: AdamW learning rate.

    ``forward(input_ids)`` returns the policy's logits, so the module itself can serve as the
    reference scorer: scored before training, it is the usual "reference = initial policy".

    Examples:
        >>> import torch
        >>> module = DPOPolicyModule(d_model=16, n_layers=1, n_heads=2)
        >>> batch = {
        ...     "input_ids": torch.tensor([[1, 4, 2], [1, 5, 2]]),
        ...     "target_tokens": torch.tensor([[4, 2, 0], [5, 2, 0]]),
        ...     "weights": torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]),
        ... }
        >>> module.training_step(batch, 0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: DPOPolicyModule: the batch has no 'ref_logprobs' - the reference logprobs were not attached...
    """

    def __init__(
        self,
        vocab_size: PositiveInt = DEMO_VOCAB_SIZE,
        d_model: PositiveInt = 64,
        n_layers: PositiveInt = 2,
        n_heads: PositiveInt = 4,
        max_seq_len: PositiveInt = 32,
        beta: PositiveFloat = 0.1,
        lr: PositiveFloat = 1e-3,
    ) -> None:
        super().__init__(beta=beta, lr=lr)
        self.save_hyperparameters()
        self.policy = TinyCausalLM(vocab_size, d_model, n_layers, n_heads, max_seq_len)

    @override
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The policy's logits ``[B, T, V]``."""
        return self.policy(input_ids)
