"""Target-token log-probabilities without full-vocabulary float32 logits: two ways.

- **Output-head path** (``OutputHead``): for a model that exposes its output layer (Hugging Face's
  ``get_output_embeddings()``), the layer's ``forward`` is replaced while the model runs: it
  receives the final hidden states, computes each target token's log-probability from them a few
  rows at a time (``head_logprobs``: ``h @ W.T`` for a chunk of rows, the model's logit transform,
  logsumexp over the vocabulary minus the target's logit) and returns a ``[B, T, 1]`` placeholder,
  so the model's own ``[B, T, V]`` logits never exist. The extra memory of a batch is that of
  one chunk, O(rows_per_chunk x V), whatever the batch size. The computation runs *inside* the
  model's forward, where sharded strategies (FSDP, FSDP2) have gathered the head's weight.
  Logit soft-capping (Gemma 2 and 3, ``final_logit_softcapping``) and scaling (Cohere,
  ``logit_scale``) are applied; a model with any other known post-head transform takes the
  general path, and ``OutputHead.verify`` compares both ways once on a short probe before a run.
  The idea is Liger-Kernel's fused linear cross-entropy (chunked rows through the head), here
  without the backward and in plain torch.
- **General path** (``loops_callbacks.token_logprobs(logits, targets, dtype=torch.float32)``, called
  by the scorer): the model's logits ``[B, T, V]`` (in its own dtype), turned into float32
  log-probabilities a few rows at a time and gathered at the targets.

Both paths end in ``token_logprobs``, the package's one target-token log-probability formula.

Examples:
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> hidden, head = torch.randn(5, 8), torch.nn.Linear(8, 11)
    >>> targets = torch.tensor([1, 2, 3, 4, 5])
    >>> chunked = head_logprobs(hidden, targets, head.weight, head.bias, LogitTransform(), rows_per_chunk=2)
    >>> full = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None])[:, 0]
    >>> bool(torch.allclose(chunked, full, atol=1e-6))
    True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loops_callbacks.logprobs import token_logprobs

__all__ = [
    "LogitTransform",
    "OutputHead",
    "find_output_head",
    "head_logprobs",
    "model_logits",
]

# Config attributes of post-head logit transforms this module does not apply: a model having one
# takes the general path (Granite divides by ``logits_scaling`` where another model multiplies).
_UNSUPPORTED_TRANSFORMS = ("logits_scaling", "output_multiplier", "lm_head_multiplier", "output_multiplier_scale")


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to ``h @ W.T`` before its softmax: ``scale`` (multiply), then ``softcap``.

    Examples:
        >>> import torch
        >>> LogitTransform(softcap=2.0)(torch.tensor([0.0, 100.0])).tolist()
        [0.0, 2.0]
    """

    scale: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Applied in place on float32 logits (a fresh chunk, owned by the caller)."""
        if self.scale is not None:
            logits.mul_(self.scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


def head_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    *,
    rows_per_chunk: int,
) -> torch.Tensor:
    """``out[n]`` = log softmax(transform(hidden[n] @ weight.T + bias))[targets[n]], float32, in row chunks.

    ``hidden`` is ``[N, H]`` in the model's dtype; each chunk's logits are computed in that dtype
    (as the model computes them), then turned into float32 log-probabilities by one fused
    log-softmax (after the transform, in float32, when there is one) and gathered at the targets.
    Peak extra memory: one chunk of logits in the model's dtype and two in float32. (A fused
    log-softmax over a chunk that stays in cache beats a hand-made logsumexp of several passes.)
    """
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    identity = transform.scale is None and transform.softcap is None
    for start in range(0, hidden.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, hidden.shape[0])
        logits = F.linear(hidden[start:stop], weight, bias)
        if not identity:
            logits = transform(logits.to(torch.float32, copy=True))
        out[start:stop] = token_logprobs(logits, targets[start:stop], dtype=torch.float32, rows_per_chunk=stop - start)
        del logits
    return out


def model_logits(output: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The logits ``[B, T, V]`` in a model's output: a tensor, ``.logits`` or the first of a tuple."""
    if isinstance(output, torch.Tensor):
        logits = output
    elif getattr(output, "logits", None) is not None:
        logits = output.logits
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        logits = output[0]
    else:
        raise TypeError(
            f"the model returned {type(output).__name__}; expected logits [B, T, V] or an object with .logits"
        )
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"the model returned logits of shape {tuple(logits.shape)} for input_ids of shape "
            f"{tuple(input_ids.shape)}; expected [B, T, V] = [{input_ids.shape[0]}, {input_ids.shape[1]}, V]"
        )
    return logits


class OutputHead:
    """A model's output layer (an ``nn.Linear``) and its logit transform; see the module docstring.

    Use ``find_output_head(model)`` to get one. ``capture`` replaces the layer's ``forward`` for
    one model call; ``verify`` checks, once, that the chunked computation gives the model's logits.

    Examples:
        >>> import torch
        >>> class LM(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed, self.lm_head = torch.nn.Embedding(9, 4), torch.nn.Linear(4, 9)
        ...     def get_output_embeddings(self):
        ...         return self.lm_head
        ...     def forward(self, ids):
        ...         return self.lm_head(self.embed(ids))
        >>> model = LM()
        >>> head, why = find_output_head(model)
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> with torch.no_grad(), head.capture(ids[:, 1:], rows_per_chunk=2) as result:
        ...     placeholder = model(ids)
        >>> tuple(placeholder.shape), tuple(result.logprobs.shape)
        ((1, 3, 1), (1, 2))
    """

    def __init__(self, module: nn.Linear, transform: LogitTransform, owner: str) -> None:
        self.module = module
        self.transform = transform
        self.owner = owner

    @property
    def vocab_size(self) -> int:
        return int(self.module.out_features)

    def __repr__(self) -> str:
        return f"OutputHead({self.owner}, vocab={self.vocab_size}, {self.transform})"

    @contextmanager
    def capture(self, targets: torch.Tensor, *, rows_per_chunk: int) -> Iterator[SimpleNamespace]:
        """While the block runs, the head computes the log-probabilities of ``targets`` ``[B, T - 1]``.

        The result is in ``.logprobs`` (``[B, T - 1]`` float32) once the model has run; the model
        itself returns a ``[B, T, 1]`` placeholder instead of its logits.
        """
        captured = SimpleNamespace(logprobs=None)
        linear = self.module

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            rows, width = targets.shape[0], targets.shape[1] + 1
            if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (rows, width):
                raise ValueError(
                    f"the output head received hidden states of shape {tuple(hidden.shape)} for input_ids "
                    f"[{rows}, {width}]; score this model with output_head=False"
                )
            # Every position, the last one with a dummy target: hidden stays a free reshape.
            full_targets = torch.cat([targets, targets.new_zeros(rows, 1)], dim=1).reshape(-1)
            flat = head_logprobs(
                hidden.reshape(rows * width, -1),
                full_targets,
                linear.weight,
                linear.bias,
                self.transform,
                rows_per_chunk=rows_per_chunk,
            )
            captured.logprobs = flat.view(rows, width)[:, :-1]
            return hidden.new_zeros(()).expand(rows, width, 1)

        with _replaced_forward(linear, forward):
            yield captured
        if captured.logprobs is None:
            raise RuntimeError(
                f"the output head {self.owner} was not called by the model's forward (a compiled model?); "
                "score this model with output_head=False"
            )

    def verify(self, call: Callable[[torch.Tensor], Any], probe: torch.Tensor) -> str:
        """``""`` when the chunked head reproduces the model's logits on ``probe``, else why not.

        One forward of ``probe`` (``[1, T]`` ids): the head's real ``forward`` runs, and from the
        same hidden states the chunked computation's logits are compared with the model's output
        (relative to the largest logit, within 8 units of the coarsest precision involved).
        """
        linear = self.module
        original = linear.forward
        seen: dict[str, torch.Tensor] = {}
        dtypes: set[torch.dtype] = set()

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), linear.weight, linear.bias)
            dtypes.update({hidden.dtype, logits.dtype, linear.weight.dtype})
            seen["ours"] = self.transform(logits.float())
            return original(hidden)

        with _replaced_forward(linear, forward):
            output = call(probe)
        if "ours" not in seen:
            return f"the output head {self.owner} was not called by the model's forward (a compiled model?)"
        try:
            logits = model_logits(output, probe)
        except (TypeError, ValueError, RuntimeError) as error:
            return f"the model's output does not hold its logits as expected ({error})"
        dtypes.add(logits.dtype)
        theirs = logits.float().reshape(-1, logits.shape[-1])
        ours = seen["ours"]
        if ours.shape != theirs.shape:
            return f"the head's logits have shape {tuple(ours.shape)}, the model's {tuple(theirs.shape)}"
        scale = max(1.0, float(theirs.abs().max()))
        error = float((ours - theirs).abs().max()) / scale
        # 8 units of the coarsest precision on the way (weights, autocast, the model's logits)
        tolerance = max(1e-5, *(8 * torch.finfo(d).eps for d in dtypes if d.is_floating_point))
        if not math.isfinite(error) or error > tolerance:
            return (
                f"the model transforms its logits after the output head in a way not applied here "
                f"(relative difference {error:.2e} > {tolerance:.1e})"
            )
        return ""


@contextmanager
def _replaced_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module.forward`` is ``forward`` while the block runs (hooks, e.g. FSDP's, still run around it)."""
    previous = module.__dict__.get("forward")  # an instance's own forward (None: the class's)
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is not None:
            module.forward = previous  # type: ignore[method-assign]
        else:
            del module.forward


def _unwrap(module: Any) -> Any:
    """The layer inside FSDP (1) / activation-checkpointing / ``torch.compile`` wrappers."""
    for attribute in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"):
        while isinstance(getattr(module, attribute, None), nn.Module):
            module = getattr(module, attribute)
    return module


def _transform_of(owner: nn.Module) -> tuple[LogitTransform | None, str]:
    """The post-head transform of a Hugging Face causal LM, from its config, or why it is not known."""
    config = getattr(owner, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
    for source in (*configs, owner, getattr(owner, "model", None)):
        for name in _UNSUPPORTED_TRANSFORMS:
            value = getattr(source, name, None)
            if value is not None and value != 1:
                return None, f"{type(owner).__name__} transforms its logits with {name}={value!r}"
    softcap = next((c.final_logit_softcapping for c in configs if getattr(c, "final_logit_softcapping", None)), None)
    scale = getattr(owner, "logit_scale", None)
    if scale is None:
        scale = next((c.logit_scale for c in configs if getattr(c, "logit_scale", None) is not None), None)
    for name, value in (("final_logit_softcapping", softcap), ("logit_scale", scale)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            return None, f"{name} is a {type(value).__name__}, not a number"
    return LogitTransform(scale=None if scale is None else float(scale),
                          softcap=None if softcap is None else float(softcap)), ""


def find_output_head(model: nn.Module) -> tuple[OutputHead | None, str]:
    """The output head of ``model`` (or of its first submodule with ``get_output_embeddings()``).

    Returns ``(head, "")``, or ``(None, why)`` when the general path must be used: no
    ``get_output_embeddings``, a head that is not an ``nn.Linear``, or an unsupported transform.
    """
    for name, owner in model.named_modules():
        get_output_embeddings = getattr(owner, "get_output_embeddings", None)
        if not callable(get_output_embeddings):
            continue
        try:
            head = _unwrap(get_output_embeddings())
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if head is None:
            continue
        if not isinstance(head, nn.Linear):
            return None, f"the output head of {type(owner).__name__} is a {type(head).__name__}, not an nn.Linear"
        transform, why = _transform_of(owner)
        if transform is None:
            return None, why
        return OutputHead(head, transform, name or type(owner).__name__), ""
    return None, f"{type(model).__name__} exposes no output head (get_output_embeddings())"
