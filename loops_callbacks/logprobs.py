"""``token_logprobs``: the log-probability a model gives each target token, from its logits.

The one implementation of the formula in the package: the DPO policy (``models.DPOModule``), the
reference scorer (``reference.heads``, both paths) and the demo models all call it, so policy and
reference numbers cannot drift apart. Use it in a ``training_step`` to get the trainer logprobs
that ``KLSampleTrainMonitor`` compares with the sampler's.

Position k of ``logits`` predicts ``target_tokens[k]`` (for a causal LM fed ``input_ids``,
``target_tokens[k] = input_ids[k + 1]``). It runs in float32 whatever the logits' dtype (float64
logits stay float64 unless ``dtype`` says otherwise), as the target's logit minus the logsumexp of
the row (TRL's route): a fused ``log_softmax``'s CPU kernels lose about 1e-5 per token, always the same
way, 10x the error of this route against a float64 forward. Without autograd it runs a few rows at a
time, so its float32 temporaries stay small next to the model's own logits.

Examples:
    >>> import torch
    >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]], dtype=torch.bfloat16)  # [B=1, T=2, V=2]
    >>> out = token_logprobs(logits, torch.tensor([[1, 0]]))
    >>> out.dtype, [round(v, 4) for v in out[0].tolist()]
    (torch.float32, [-0.6931, -0.1269])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from loops_callbacks.validation import check, check_bool, check_int

__all__ = ["TokenLogprobs", "token_logprobs"]


class TokenLogprobs(NamedTuple):
    """``token_logprobs(..., with_entropy=True)``: each position's target logprob, and the entropy H and
    varentropy V = Var(log p) = E_p[(log p)²] - H² of its whole distribution (float32, no gradient).

    If the target was drawn from that distribution, E[logprob] = -H and Var[logprob] = V: the monitor
    checks what was sampled with them (``training_entropy`` and ``training_varentropy`` in the batch).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    varentropy: torch.Tensor

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The three under the keys ``KLSampleTrainMonitor`` reads from ``training_step``'s output."""
        return {"training_logprobs": self.logprobs, "training_entropy": self.entropy, "training_varentropy": self.varentropy}

# Float32 log-probabilities made at a time when nothing is recorded for a backward pass: at most
# this many elements (16 MiB; at least one row of dim 0), small next to the model's own logits.
_CHUNK_ELEMENTS = 1 << 22
_LOG_ZERO = -1e4  # a log-probability below it has probability 0 in float32


def token_logprobs(
    logits: torch.Tensor | Any, target_tokens: torch.Tensor, *, dtype: torch.dtype | None = None,
    rows_per_chunk: int | None = None, with_entropy: bool = False,
) -> torch.Tensor | TokenLogprobs:
    """``out[b, k] = log softmax(logits[b, k])[target_tokens[b, k]]``, computed in float32.

    Args:
        logits: ``[B, T, V]`` (any leading dimensions: ``[..., V]``) in any floating dtype, or a
            model output holding them as ``.logits`` (a Hugging Face ``CausalLMOutput``).
        target_tokens: integer ``[B, T]`` ids (the leading dimensions of ``logits``); for a causal
            LM fed ``input_ids``, ``target_tokens[:, k] = input_ids[:, k + 1]``.
        dtype: the dtype of the log-softmax and the result; ``None`` for float32 (float64 when
            the logits are float64).
        rows_per_chunk: rows of dim 0 per log-softmax when autograd records nothing (``None``:
            as many as fit in 16 MiB of float32, at least one). Under autograd, one call.
        with_entropy: also return each position's entropy and varentropy (``TokenLogprobs``), from
            the same log-softmax: one more pass over the vocabulary, a few positions at a time
            (16 MiB of float32 temporaries at most, whatever the vocabulary).

    Returns:
        ``[B, T]`` logprobs on the logits' device, differentiable (with ``with_entropy``, a
        ``TokenLogprobs`` of three ``[B, T]`` tensors). The values do not depend on
        ``rows_per_chunk`` (each row's log-softmax is computed alone).

    An id outside ``[0, V)`` (-100, Hugging Face's ignore index, too: a position to leave out belongs in
    the mask) is a ``ValueError`` naming the id, how many positions hold it and the first. The ids are read
    only when gathering them fails, so the healthy path never waits for the device; on an accelerator, where
    a failed gather leaves nothing to read, the error is the device's own.

    Examples:
        >>> import torch
        >>> torch.manual_seed(0) and None
        >>> logits, targets = torch.randn(2, 3, 5), torch.tensor([[0, 4, 2], [1, 1, 3]])
        >>> out = token_logprobs(logits, targets)
        >>> bool(torch.allclose(out, logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0], atol=1e-6))
        True
        >>> token_logprobs(logits, targets[:, :2])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: token_logprobs: logits [2, 3, 5] and target_tokens [2, 2] do not share the leading dimensions...
    """
    logits = _logits_of(logits)
    check("token_logprobs: target_tokens", target_tokens, torch.Tensor, "a tensor of token ids")
    if target_tokens.is_floating_point() or target_tokens.is_complex() or target_tokens.dtype == torch.bool:
        raise TypeError(f"token_logprobs: target_tokens must hold integer token ids, got dtype {target_tokens.dtype}")
    if logits.dim() < 2 or logits.shape[:-1] != target_tokens.shape:
        raise ValueError(
            f"token_logprobs: logits {list(logits.shape)} and target_tokens {list(target_tokens.shape)} do not "
            "share the leading dimensions (logits are [..., V], target_tokens [...])"
        )
    check_int("token_logprobs rows_per_chunk", rows_per_chunk, least=1, optional=True)
    check_bool("token_logprobs with_entropy", with_entropy)
    if dtype is None:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    try:
        return _token_logprobs(logits, target_tokens.long().unsqueeze(-1), dtype, rows_per_chunk, with_entropy)
    except (IndexError, RuntimeError):  # the ids are read only when gathering failed: the healthy path never waits
        _refuse_targets(target_tokens, logits.shape[-1])
        raise


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, rows_per_chunk: int | None,
                    with_entropy: bool) -> torch.Tensor | TokenLogprobs:
    """``token_logprobs`` of checked arguments, ``targets`` ``[..., 1]`` int64."""
    rows = logits.shape[0]
    if torch.is_grad_enabled() and logits.requires_grad:
        rows_per_chunk = rows  # every chunk's log-softmax would be kept for the backward pass anyway
    elif rows_per_chunk is None:
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, logits[:1].numel()))
    if rows_per_chunk >= rows:
        if torch.is_grad_enabled() and logits.requires_grad:
            logprobs, normalizer = _TargetLogprobs.apply(logits, targets, dtype)
        else:
            logprobs, normalizer = _target_logprobs(logits, targets, dtype)
        if not with_entropy:
            return logprobs
        return TokenLogprobs(logprobs, *_entropy_and_varentropy(logits.detach().to(dtype) - normalizer))
    parts = [
        _token_logprobs(chunk, chunk_targets, dtype, rows, with_entropy)
        for chunk, chunk_targets in zip(logits.split(rows_per_chunk), targets.split(rows_per_chunk))
    ]
    if with_entropy:
        return TokenLogprobs(*(torch.cat(column) for column in zip(*parts)))
    return torch.cat(parts)


def _refuse_targets(target_tokens: torch.Tensor, vocabulary: int) -> None:
    """A ``ValueError`` naming an id of ``target_tokens`` outside ``[0, vocabulary)``: how many positions hold it,
    the first, and (for -100) where ignored positions belong. Read on the CPU only: elsewhere a failed gather leaves
    the device unable to say more (an out-of-range id is then the device's own error)."""
    if target_tokens.device.type != "cpu":
        return
    outside = (target_tokens < 0) | (target_tokens >= vocabulary)
    if not bool(outside.any()):
        return
    first = [int(i) for i in outside.nonzero()[0]]
    value = int(target_tokens[tuple(first)])
    same, count = int((target_tokens == value).sum()), int(outside.sum())
    others = f" (and {count - same} more positions outside [0, {vocabulary}))" if count > same else ""
    ignored = value == -100
    fix = (": a position to leave out belongs in the mask (0 there), with any id in range (target_tokens.clamp(min=0))"
           if ignored else f" for logits of {vocabulary} classes (ids and logits of one tokenizer, logits not cut)")
    named = " (Hugging Face's ignore index)" if ignored else ""
    raise ValueError(
        f"token_logprobs: target_tokens holds {value}{named} at {same} position{'s' if same != 1 else ''}, first "
        f"{first}{others}; token ids are in [0, {vocabulary}){fix}"
    )


@torch.no_grad()
def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets' logprobs ``[...]`` and each row's log-normalizer ``[..., 1]`` (logsumexp), in ``dtype``."""
    wide = logits.to(dtype)
    normalizer = torch.logsumexp(wide, dim=-1, keepdim=True)
    return (wide.gather(-1, targets) - normalizer).squeeze(-1), normalizer


class _TargetLogprobs(torch.autograd.Function):
    """``_target_logprobs`` with its gradient in one pass, ``g * (onehot(target) - softmax)``: autograd's own
    route through ``logsumexp`` and ``gather`` takes 1.6x the time of a fused ``log_softmax``; this one, none
    more. It keeps the logits (in their dtype) and the normalizers for the backward pass, not a float32 copy."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, normalizer = _target_logprobs(logits, targets, dtype)
        ctx.save_for_backward(logits, targets, normalizer)
        ctx.mark_non_differentiable(normalizer)
        return logprobs, normalizer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[torch.Tensor, None, None]:
        logits, targets, normalizer = ctx.saved_tensors
        grad = grad.unsqueeze(-1)
        softmax = logits.to(normalizer.dtype, copy=True).sub_(normalizer).exp_()
        return softmax.mul_(grad.neg()).scatter_add_(-1, targets, grad).to(logits.dtype), None, None


@torch.no_grad()
def _entropy_and_varentropy(log_softmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy H = -sum p log p and varentropy E[(log p)^2] - H^2 of each distribution of ``log_softmax``
    ``[..., V]``, in its dtype (float32 or wider), a few positions at a time; a token of probability 0 (a
    logit of -inf) adds nothing. One exp, one product, one sum and one fused multiply-sum (``vecdot``) per chunk."""
    flat = log_softmax.detach().reshape(-1, log_softmax.shape[-1])
    entropy = torch.empty(flat.shape[0], dtype=flat.dtype, device=flat.device)
    second = torch.empty_like(entropy)
    step = max(1, _CHUNK_ELEMENTS // max(1, flat.shape[-1]))
    for start in range(0, flat.shape[0], step):  # positions in chunks: the temporaries stay small
        logp = flat[start : start + step].clamp(min=_LOG_ZERO)  # exp(-1e4) is 0 and its square stays finite
        p_logp = logp.exp().mul_(logp)
        entropy[start : start + step] = p_logp.sum(-1).neg_()
        second[start : start + step] = torch.linalg.vecdot(p_logp, logp)
    varentropy = second.sub_(entropy.square()).clamp_(min=0.0)
    shape = log_softmax.shape[:-1]
    return entropy.reshape(shape), varentropy.reshape(shape)


def _logits_of(logits: torch.Tensor | Any) -> torch.Tensor:
    """The floating tensor of logits itself, or a model output's ``.logits``."""
    if not isinstance(logits, torch.Tensor):
        inner = getattr(logits, "logits", None)
        if not isinstance(inner, torch.Tensor):
            raise TypeError(
                f"token_logprobs: logits must be a [B, T, V] tensor or a model output with .logits, "
                f"got {type(logits).__name__}"
            )
        logits = inner
    if not logits.is_floating_point():
        raise TypeError(f"token_logprobs: logits must be floating point, got dtype {logits.dtype}")
    return logits
