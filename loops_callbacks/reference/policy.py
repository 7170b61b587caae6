"""``PolicyReference``: the policy itself as the DPO reference, scored in place under the training strategy.

DPO's usual reference is the initial policy. Instead of a frozen copy (twice the weights, taken
before the strategy has placed or sharded anything), the LightningModule is scored as it is once
the strategy has set it up (moved to its device, wrapped by DDP, sharded by FSDP / FSDP2, built in
``configure_model``) and before the first optimizer step: when the trainer first asks the
DataModule for data (``ReferenceLogprobsMixin``). No copy of the weights exists at any time.

- The module is called as ``module(input_ids)`` (through the FSDP (1) root wrapper when there is
  one, so that its weights are gathered), in eval mode, under ``torch.no_grad()`` (FSDP's
  collectives cannot run under ``inference_mode``), and in the training precision
  (``trainer.precision_plugin.forward_context()``, e.g. bf16 autocast) unless ``scoring_dtype``
  asks for another autocast dtype. Nothing of the module is cast or moved.
- Every rank scores its share in lock-step (``TokenScorer``): the same number of forward passes
  on every rank, so a forward that is a collective never hangs.
- ``fingerprint()`` is a collective (``loops_callbacks.reference.fingerprint``): the same digest
  whatever the placement or sharding, without gathering the whole model on one rank.

Examples:
    >>> import torch
    >>> from loops_callbacks.reference.packing import PackedTokens
    >>> policy = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    >>> reference = PolicyReference(policy)
    >>> reference.score_packed(PackedTokens.from_sequences([[1, 2, 3]])).shape, len(reference.fingerprint())
    (torch.Size([3]), 64)
    >>> next(policy.parameters()).requires_grad  # used in place, left as it was
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loops_callbacks.reference.clients import find_vocab_size, module_device
from loops_callbacks.distributed import ProcessGroup, StallGuard
from loops_callbacks.reference.fingerprint import fsdp_classes, weights_fingerprint
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.reference.scorer import TokenScorer
from loops_callbacks.validation import FLOAT_DTYPES

__all__ = ["PolicyReference", "policy_tag"]

Autocast = Callable[[], contextlib.AbstractContextManager[Any]]


def policy_tag(trainer: Any, scoring_dtype: str | None) -> str:
    """The policy's cache tag: what its values depend on besides its weights (the autocast dtype, or the precision).

    Examples:
        >>> class Trainer:
        ...     precision = "bf16-mixed"
        >>> policy_tag(Trainer(), None), policy_tag(Trainer(), "float16")
        ('policy|precision=bf16-mixed', 'float16')
    """
    return scoring_dtype or f"policy|precision={trainer.precision}"


class PolicyReference(TokenScorer):
    """The policy module as a reference scorer, used in place; see the module docstring.

    Its scoring methods (``score_packed``, and the ``SamplingClient`` forms ``compute_logprobs`` /
    ``compute_logprobs_batch``) run in lock-step: every rank of a process group calls them at once
    (``scores_in_lockstep``).

    Args:
        module: the policy (a LightningModule, or any causal LM ``module(input_ids) -> logits``).
        forward_module: what to call instead of ``module`` (the FSDP (1) root that wraps it).
        device: where batches are built (default: where the module's weights are).
        scoring_dtype: ``"bfloat16"`` / ``"float16"``: autocast to that dtype; ``"float32"``: no
            autocast, the weights must be float32; ``None``: ``autocast``, the training precision.
        max_tokens_per_batch: padded tokens per forward (``None``: the scorer's default).
        autocast: context manager factory of the training precision (used when ``scoring_dtype`` is None).
        tag: what else the values depend on (the precision), part of the fingerprint.
        output_head: score from the output head when the module exposes one.
    """

    scores_in_lockstep = True  # its forwards may be collectives (FSDP): every rank runs as many

    def __init__(self, module: nn.Module, *, forward_module: nn.Module | None = None,
                 device: str | torch.device | None = None, scoring_dtype: str | None = None,
                 max_tokens_per_batch: int | None = None, autocast: Autocast | None = None, tag: str = "policy",
                 output_head: bool = True) -> None:
        self.forward_module = forward_module if forward_module is not None else module
        self.tag = tag
        device = torch.device(device) if device is not None else module_device(module)
        super().__init__(self.forward_module, module=module, device=device, max_tokens_per_batch=max_tokens_per_batch,
                         output_head=output_head, vocab_size=find_vocab_size(module),
                         autocast=_autocast(module, device, scoring_dtype, autocast), grad_mode="no_grad")

    @classmethod
    def from_trainer(cls, trainer: Any, *, scoring_dtype: str | None = None,
                     max_tokens_per_batch: int | None = None) -> PolicyReference:
        """The trainer's LightningModule as the strategy has set it up, on the strategy's root device."""
        module, wrapped, (fsdp, _) = trainer.lightning_module, trainer.strategy.model, fsdp_classes()
        return cls(module, forward_module=wrapped if fsdp is not None and isinstance(wrapped, fsdp) else module,
                   device=trainer.strategy.root_device, scoring_dtype=scoring_dtype,
                   max_tokens_per_batch=max_tokens_per_batch, autocast=trainer.precision_plugin.forward_context,
                   tag=policy_tag(trainer, scoring_dtype))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({type(self.module).__name__}, device={str(self.device)!r}, tag={self.tag!r}, "
                f"max_tokens_per_batch={self.max_tokens_per_batch}, path={self.path!r})")

    def fingerprint(self) -> str:
        """The weights' fingerprint (a collective: call it on every rank at once)."""
        with torch.inference_mode(False), torch.no_grad():
            return weights_fingerprint(self.forward_module, tag=self.tag, group=ProcessGroup())

    def score_packed(self, packed: PackedTokens, *, progress: Callable[[int], None] | None = None,
                     lockstep: StallGuard | None = None) -> torch.Tensor:
        """``ref_logprobs``-layout values of ``packed``, in lock-step with the other ranks (call it on all)."""
        try:
            guard = lockstep if lockstep is not None else StallGuard(ProcessGroup(), timeout=None)
            return super().score_packed(packed, progress=progress, lockstep=guard)
        finally:
            # FSDP2 keeps the root's weights gathered after a forward (for the backward that follows one); after
            # scoring there is none: shard them again, so that training starts as it would have
            _, fsdp2 = fsdp_classes()
            for m in self.module.modules():
                if fsdp2 is not None and isinstance(m, fsdp2):
                    m.reshard()


def _autocast(module: nn.Module, device: torch.device, scoring_dtype: str | None,
              autocast: Autocast | None) -> Autocast | None:
    """The autocast that ``scoring_dtype`` asks for (``None``: ``autocast``, the training precision)."""
    if scoring_dtype is None:
        return autocast
    if scoring_dtype in ("bfloat16", "float16"):
        return lambda: torch.autocast(device.type, dtype=FLOAT_DTYPES[scoring_dtype])
    low = sorted({str(p.dtype) for p in module.parameters() if p.is_floating_point()} - {"torch.float32"})
    if low:
        raise ValueError(f"scoring_dtype='float32' cannot be honoured by the policy itself: its weights are {low} "
                         "and it is not copied; use scoring_dtype=None (the training precision) or pass a float32 "
                         "reference=")
    return lambda: torch.autocast(device.type, enabled=False)
