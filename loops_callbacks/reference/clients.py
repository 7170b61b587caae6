"""Reference-model scoring: the ``SamplingClient`` protocol and a local, batched torch scorer.

A *sampling client* answers ``compute_logprobs(prompt)`` with one log-probability per token of
``prompt``: element i is log p(token i | tokens before i), and element 0 is ``None`` (nothing
predicts the first token). Remote clients (Tinker, Baseten Loops) implement it over the network;
``TorchSamplingClient`` implements it over a local frozen causal LM, scoring many prompts per
forward pass (it is a ``loops_callbacks.reference.scorer.TokenScorer``), and ``score_packed``
gives the same values for packed token ids, flat, in the ``ref_logprobs`` layout.

Examples:
    >>> import torch
    >>> from loops_callbacks.types import ModelInput
    >>> model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    >>> client = TorchSamplingClient.snapshot(model)
    >>> logprobs = client.compute_logprobs(ModelInput.from_ints([3, 1, 4]))
    >>> logprobs[0] is None, len(logprobs), client.vocab_size
    (True, 3, 16)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from loops_callbacks.distributed import ProcessGroup
from loops_callbacks.reference.fingerprint import weights_fingerprint
from loops_callbacks.reference.scorer import ScorerClient, TokenScorer
from loops_callbacks.types import ModelInput
from loops_callbacks.validation import check, check_bool, check_dtype, check_int

__all__ = ["SamplingClient", "ScorerClient", "TorchSamplingClient", "frozen_copy"]


@runtime_checkable
class SamplingClient(Protocol):
    """Anything that scores the tokens of a prompt under a (reference) model.

    ``compute_logprobs(prompt)`` returns one value per token of ``prompt``: element i is
    log p(token i | tokens before i); element 0 is ``None`` and other elements may be ``None``.
    Tinker's client returns a future instead (resolved with ``.result()``); both work with
    ``attach_reference_logprobs``. A client may also offer ``compute_logprobs_async(prompt)``
    (a coroutine) and/or ``compute_logprobs_batch(prompts) -> list[list[float | None]]``, which
    ``attach_reference_logprobs`` prefers when present.

    Examples:
        >>> class Uniform:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-2.0] * (prompt.length - 1)
        >>> isinstance(Uniform(), SamplingClient)
        True
    """

    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]: ...


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` in eval mode with ``requires_grad_(False)``; ``module`` itself is untouched.

    Examples:
        >>> layer = torch.nn.Linear(2, 2)
        >>> copy_ = frozen_copy(layer)
        >>> copy_ is layer, copy_.training, layer.weight.requires_grad
        (False, False, True)
    """
    check("module", module, nn.Module, "a torch.nn.Module")
    frozen = copy.deepcopy(module)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def module_device(module: nn.Module) -> torch.device:
    """Where the module's first parameter or buffer is (the CPU for a module without any)."""
    return next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))


def find_vocab_size(model: nn.Module) -> int | None:
    """The output vocabulary size, from the first of: ``config.vocab_size``,
    ``get_output_embeddings().out_features``, a ``vocab_size`` attribute, the last ``nn.Linear``."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    heads = getattr(model, "get_output_embeddings", None)
    if not isinstance(size, int) and callable(heads):
        size = getattr(heads(), "out_features", None)
    if not isinstance(size, int):
        size = getattr(model, "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


class TorchSamplingClient(TokenScorer):
    """A ``SamplingClient`` over a local causal LM, scoring many prompts per forward pass.

    ``model`` is an ``nn.Module`` that maps token ids ``LongTensor[B, T]`` to logits ``[B, T, V]``
    (or returns an object with ``.logits``, as Hugging Face models do), or a plain callable
    ``fn(input_ids) -> logits``, called as ``model(input_ids)`` and nothing else: prompts are
    right-padded, and with causal attention a real position never attends to the padding after
    it, so a padded row scores as it would alone (up to float rounding). Prompts are sorted by
    length and cut into batches of at most ``max_tokens_per_batch`` padded tokens, built on the
    device and scored in eval mode under ``torch.inference_mode()``. A module that exposes its
    output head (Hugging Face's ``get_output_embeddings()``) is scored from its final hidden states
    a chunk of rows at a time, never holding its ``[B, T, V]`` logits (``loops_callbacks.reference.heads``).

    The model is used in place, not copied: ``device`` / ``dtype`` move or cast it like
    ``module.to`` (``None`` keeps where and how it is). Use ``snapshot`` for a frozen copy.

    Args:
        model: the causal LM (an ``nn.Module``) or a callable ``fn(input_ids) -> logits``.
        device: where to score (default: where the model's parameters are; the CPU for a callable).
        dtype: cast the model to this floating dtype (``torch.bfloat16`` or ``"bfloat16"``, ...);
            not for a callable.
        max_tokens_per_batch: padded-token budget of one forward pass; default by device type
            (``loops_callbacks.reference.scorer.default_tokens_per_batch``).
        output_head: score from the output head when the model exposes one (``False``: always
            the model's logits).

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
        >>> client = TorchSamplingClient(model, max_tokens_per_batch=64)
        >>> [len(lp) for lp in client.compute_logprobs_batch([[1, 2, 3], [4], [5, 6]])]
        [3, 1, 2]
        >>> uniform = TorchSamplingClient(lambda ids: torch.zeros(*ids.shape, 4))
        >>> [round(v, 4) for v in uniform.compute_logprobs([1, 2])[1:]]
        [-1.3863]
    """

    def __init__(self, model: nn.Module | Callable[[torch.Tensor], Any], *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, max_tokens_per_batch: int | None = None,
                 output_head: bool = True) -> None:
        device, dtype = _checked(model, device, dtype, max_tokens_per_batch, output_head)
        module = model if isinstance(model, nn.Module) else None
        if module is not None and (device is not None or dtype is not None):
            module.to(device=device, dtype=dtype)
        self.model = model
        self.dtype: torch.dtype | None = None
        if module is not None:
            device = device if device is not None else module_device(module)
            floating = (t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point())
            self.dtype = dtype if dtype is not None else next(floating, torch.float32)
        super().__init__(model, module=module, device=device if device is not None else "cpu",
                         max_tokens_per_batch=max_tokens_per_batch, output_head=output_head,
                         vocab_size=find_vocab_size(module) if module is not None else None)

    @classmethod
    def snapshot(cls, module: nn.Module, *, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, max_tokens_per_batch: int | None = None,
                 output_head: bool = True) -> TorchSamplingClient:
        """A client over a frozen deep copy of ``module``, pinned to its weights of now.

        The copy is in eval mode with ``requires_grad_(False)``, cast/moved to ``dtype`` /
        ``device`` when given; later training of ``module`` does not change it, and ``module``
        itself is untouched (Tinker's ``save_weights_and_get_sampling_client``, locally). It costs a
        second copy of the weights: ``DPODataModule``'s default reference is the policy itself
        instead. The keywords are checked before the copy is made.

        Examples:
            >>> policy = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
            >>> reference = TorchSamplingClient.snapshot(policy, dtype="float64")
            >>> reference.model is policy, reference.dtype, next(policy.parameters()).dtype
            (False, torch.float64, torch.float32)
        """
        _checked(module, device, dtype, max_tokens_per_batch, output_head)
        return cls(frozen_copy(module), device=device, dtype=dtype, max_tokens_per_batch=max_tokens_per_batch,
                   output_head=output_head)

    def __repr__(self) -> str:
        name = type(self.model).__name__ if isinstance(self.model, nn.Module) else "callable"
        return (f"{type(self).__name__}({name}, device={str(self.device)!r}, dtype={self.dtype}, "
                f"max_tokens_per_batch={self.max_tokens_per_batch}, vocab_size={self.vocab_size}, path={self.path!r})")

    def fingerprint(self) -> str | None:
        """A sha256 hex digest of the scoring model's class, weights and dtype (``None`` for a callable: give
        ``reference_fingerprint`` to cache its results); it reads every weight (a cache key, not a per-step check).

        Examples:
            >>> len(TorchSamplingClient(torch.nn.Linear(2, 2)).fingerprint())
            64
        """
        if not isinstance(self.model, nn.Module):
            return None
        return weights_fingerprint(self.model, tag=str(self.dtype), group=ProcessGroup(local=True))


def _checked(model: Any, device: Any, dtype: Any, max_tokens_per_batch: Any,
             output_head: Any) -> tuple[torch.device | None, torch.dtype | None]:
    """``TorchSamplingClient``'s arguments checked (``TypeError`` / ``ValueError`` naming the value); the device and
    dtype as torch objects."""
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(f"model must be a torch.nn.Module or a callable fn(input_ids) -> logits, got "
                        f"{type(model).__name__}")
    check_int("max_tokens_per_batch", max_tokens_per_batch, least=1, optional=True)
    check_bool("output_head", output_head)
    dtype = None if dtype is None else check_dtype("dtype", dtype)
    if dtype is not None and not isinstance(model, nn.Module):
        raise ValueError(f"dtype={str(dtype).removeprefix('torch.')!r} cannot cast a plain callable reference; cast "
                         "its model yourself, or pass the nn.Module")
    try:
        return (None if device is None else torch.device(device)), dtype
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device={device!r} is not a torch device: {error}") from None
