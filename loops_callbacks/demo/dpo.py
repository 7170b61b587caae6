"""DPO on a tiny causal LM, reading batches of interleaved preference pairs with reference logprobs.

A batch (as ``loops_callbacks.data.DPODataModule`` builds it) is a dict of ``[2P, T]`` tensors,
rows interleaved (row 2i = pair i's chosen sequence, row 2i+1 its rejected one), right-padded
with 0:

- ``input_ids``: the full sequence (the datum's ``model_input``);
- ``target_tokens``: ``target_tokens[k] = input_ids[k + 1]`` (position k belongs to the token
  predicted at k; the last position predicts nothing);
- ``weights``: 1.0 on response positions, 0.0 on prompt, padding and the last position;
- ``ref_logprobs``: the reference model's logprobs, same positions;
- ``attention_mask``: 1 on real tokens (unused: attention is causal and padding is on the right).

With ``pi`` and ``ref`` the weighted sums of the policy's and the reference's logprobs over a
row, the loss of pair i is ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``.

Logged (means over the batch's pairs): ``train/dpo_loss``, ``train/dpo_accuracy`` (share of pairs
with a positive margin), ``train/dpo_margin`` (chosen minus rejected reward),
``train/chosen_reward`` and ``train/rejected_reward`` (``beta * (pi - ref)``).

Example:
    >>> import torch
    >>> logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    >>> loss, metrics = dpo_loss(logprobs, torch.full((2, 2), -1.5), torch.ones(2, 2), beta=0.5)
    >>> round(loss.item(), 4), metrics["dpo_accuracy"].item(), metrics["dpo_margin"].item()
    (0.3133, 1.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.pytorch import LightningModule
from typing_extensions import override

from loops_callbacks.demo.model import TinyCausalLM, token_logprobs
from loops_callbacks.demo.tokenizer import CharTokenizer

__all__ = ["DPOPolicyModule", "dpo_loss", "DEMO_VOCAB_SIZE"]

DEMO_VOCAB_SIZE = CharTokenizer().vocab_size
"""Vocabulary of the demo tokenizer (and of ``ReverseDigitsTask`` data): the default ``vocab_size``."""

_REQUIRED_KEYS = ("input_ids", "target_tokens", "weights")


def dpo_loss(
    policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, weights: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO loss of interleaved rows, and its metrics (detached, means over pairs).

    Args:
        policy_logprobs: ``[2P, T]`` policy logprobs of the target tokens.
        ref_logprobs: ``[2P, T]`` reference logprobs (values where ``weights`` is 0 are ignored,
            even NaN).
        weights: ``[2P, T]`` per-position weights, 1.0 on response tokens.
        beta: the DPO temperature.

    Returns:
        ``(loss, metrics)`` with metrics ``dpo_loss``, ``dpo_accuracy``, ``dpo_margin``,
        ``chosen_reward``, ``rejected_reward``.
    """
    if not (policy_logprobs.shape == ref_logprobs.shape == weights.shape) or policy_logprobs.dim() != 2:
        raise ValueError(
            f"dpo_loss needs [2P, T] tensors of one shape, got policy_logprobs {tuple(policy_logprobs.shape)}, "
            f"ref_logprobs {tuple(ref_logprobs.shape)}, weights {tuple(weights.shape)}"
        )
    if policy_logprobs.shape[0] % 2:
        raise ValueError(
            f"dpo_loss needs interleaved chosen/rejected rows, got an odd number of rows: {policy_logprobs.shape[0]}"
        )
    active = weights != 0
    weights = weights.to(policy_logprobs.dtype)
    policy = (torch.where(active, policy_logprobs, 0.0) * weights).sum(dim=1)
    reference = (torch.where(active, ref_logprobs.to(policy.dtype), 0.0) * weights).sum(dim=1)
    rewards = beta * (policy - reference)
    chosen_reward, rejected_reward = rewards[0::2], rewards[1::2]
    margin = chosen_reward - rejected_reward
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "dpo_loss": loss.detach(),
        "dpo_accuracy": (margin > 0).float().mean(),
        "dpo_margin": margin.detach().mean(),
        "chosen_reward": chosen_reward.detach().mean(),
        "rejected_reward": rejected_reward.detach().mean(),
    }
    return loss, metrics


class DPOPolicyModule(LightningModule):
    """A ``TinyCausalLM`` policy trained with DPO against precomputed reference logprobs.

    Args:
        vocab_size: token ids the model accepts (default: the demo tokenizer's).
        d_model, n_layers, n_heads, max_seq_len: size of the ``TinyCausalLM`` policy.
        beta: the DPO temperature (how far from the reference the policy may move).
        lr: AdamW learning rate.

    ``forward(input_ids)`` returns the policy's logits, so the module itself can serve as the
    reference scorer: scored before training, it is the usual "reference = initial policy".

    Example:
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
        super().__init__()
        for name, value in (("beta", beta), ("lr", lr)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DPOPolicyModule {name} must be a positive number, got {value!r}")
        self.save_hyperparameters()
        self.beta = float(beta)
        self.lr = float(lr)
        self.policy = TinyCausalLM(vocab_size, d_model, n_layers, n_heads, max_seq_len)

    @override
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The policy's logits ``[B, T, V]``."""
        return self.policy(input_ids)

    def policy_logprobs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[2P, T]`` float32 policy logprobs of ``batch["target_tokens"]`` (with grad)."""
        return token_logprobs(self(batch["input_ids"]), batch["target_tokens"])

    @override
    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The same loss and metrics on held-out pairs (``DPODataModule(val_fraction=...)``), as ``val/*``."""
        return self._step(batch, "val")

    def _step(self, batch: Mapping[str, torch.Tensor], stage: str) -> torch.Tensor:
        _check_batch(batch)
        loss, metrics = dpo_loss(self.policy_logprobs(batch), batch["ref_logprobs"], batch["weights"], self.beta)
        num_pairs = batch["input_ids"].shape[0] // 2
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value, prog_bar=name in ("dpo_loss", "dpo_accuracy"), batch_size=num_pairs)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr)


def _check_batch(batch: Mapping[str, torch.Tensor]) -> None:
    if "ref_logprobs" not in batch:
        raise ValueError(
            "DPOPolicyModule: the batch has no 'ref_logprobs' - the reference logprobs were not attached. "
            "Score every datum with a frozen reference model before training: use "
            "loops_callbacks.data.DPODataModule (it attaches them), or call "
            "attach_reference_logprobs(datums, reference) from loops_callbacks.helpers on the datums the "
            f"batches are built from. The batch has keys {sorted(batch)}."
        )
    missing = [key for key in _REQUIRED_KEYS if key not in batch]
    if missing:
        raise ValueError(f"DPOPolicyModule: the batch lacks {missing}; it has keys {sorted(batch)}")
    shapes = {key: tuple(batch[key].shape) for key in (*_REQUIRED_KEYS, "ref_logprobs")}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"DPOPolicyModule: batch fields must share one [2P, T] shape, got {shapes}")
