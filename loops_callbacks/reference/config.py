"""``ReferenceConfig``, every setting of a scoring run in one object, and what a ``reference`` setting scores with.

A DataModule (``ReferenceLogprobsMixin.configure_reference``) makes one ``ReferenceConfig``,
checked when made; the same object reaches ``resolve_reference`` (how to build the scorer:
``scoring_dtype``, ``max_tokens_per_batch``) and ``score_across_ranks`` (how to score and cache).

``reference`` (``resolve_reference``) may be:

- a ``SamplingClient`` (anything with ``compute_logprobs``): used as it is;
- an ``nn.Module`` mapping ``input_ids [B, T]`` to logits ``[B, T, V]``: a frozen copy is scored
  (``TorchSamplingClient.snapshot``), so the module itself is never cast or moved;
- a plain callable ``fn(input_ids) -> logits``: called as it is (``TorchSamplingClient``);
- a path to a Lightning ``.ckpt`` (its ``"state_dict"``) or to a ``torch.save``d state dict of
  the LightningModule: loaded into a frozen copy of the LightningModule;
- ``None``: the LightningModule itself, used in place (``PolicyReference``: no copy), scored once
  the strategy has set it up, before the first optimizer step, and never on a resumed run.

The module and checkpoint ways call the (Lightning) module as ``module(input_ids)``, so its
``forward`` must take token ids and return logits (or an object with ``.logits``). A module whose
layers are built in ``configure_model`` has none before the strategy's setup to copy or load a
checkpoint into: give it the default reference, a reference module, or a client.

Examples:
    >>> config = ReferenceConfig(scoring_dtype="bfloat16", max_tokens_per_batch=4096)
    >>> config.cache_tag(), ReferenceConfig().cache_tag()
    ('bfloat16', 'model')
    >>> ReferenceConfig(max_tokens_per_batch=0)
    Traceback (most recent call last):
    ...
    ValueError: max_tokens_per_batch must be an int >= 1 or None, got 0
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient, frozen_copy
from loops_callbacks.reference.policy import PolicyReference
from loops_callbacks.validation import check, check_bool, check_dtype, check_int, check_real

__all__ = ["DEFAULT_SCORING_TIMEOUT", "ReferenceConfig", "ScoringDtype", "load_reference_checkpoint",
           "resolve_reference"]

DEFAULT_SCORING_TIMEOUT = 600.0
"""Seconds a rank waits for the others at each step of reference scoring before naming the ones that stalled."""

ScoringDtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ReferenceConfig:
    """How reference logprobs are scored and cached (each field is checked when made).

    Args:
        reference: what scores (see the module docstring); ``None``: the LightningModule itself.
        cache_dir: the cache's directory (``None``: no cache; a DataModule's default is
            ``<default_root_dir>/reference_logprobs``).
        use_cache: ``False`` scores on every run and writes nothing.
        scoring_dtype: score a local reference in this dtype (default: the model's own); the policy
            itself is not cast but run under autocast in it (default: the training precision).
        max_tokens_per_batch: padded-token budget per forward pass of a local reference.
        reference_fingerprint: the identity of a client whose weights cannot be hashed here (e.g.
            the checkpoint a remote sampler serves); without one such a client is scored on every run.
        progress: a progress bar on rank 0 while scoring.
        check_prompts: reject pairs whose chosen and rejected prompts differ (by their weights).
        scoring_timeout: seconds a rank waits for the others at each collective step before naming
            the ranks that stalled (``None``: no limit).
    """

    reference: Any = None
    cache_dir: str | None = None
    use_cache: bool = True
    scoring_dtype: ScoringDtype | None = None
    max_tokens_per_batch: int | None = None
    reference_fingerprint: str | None = None
    progress: bool = True
    check_prompts: bool = True
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT

    def __post_init__(self) -> None:
        if isinstance(self.reference, str) and not self.reference:
            raise ValueError("reference='' is not a path; use None for the LightningModule itself")
        if self.scoring_dtype is not None:
            check_dtype("scoring_dtype", self.scoring_dtype, get_args(ScoringDtype))
        check_int("max_tokens_per_batch", self.max_tokens_per_batch, least=1, optional=True)
        check("cache_dir", self.cache_dir, (str, os.PathLike), "a path", optional=True)
        if isinstance(self.cache_dir, os.PathLike):
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        check("reference_fingerprint", self.reference_fingerprint, str, "a string", optional=True)
        if self.scoring_timeout is not None:
            check_real("scoring_timeout", self.scoring_timeout, least=math.ulp(0.0),
                       what="a number of seconds > 0, or None for no limit")
        for name in ("use_cache", "progress", "check_prompts"):
            check_bool(name, getattr(self, name))

    def cache_tag(self) -> str:
        """The cache tag (``CacheKey.dtype``) of a reference scored with these settings: the scoring dtype, or
        ``"model"``."""
        return self.scoring_dtype or "model"


def resolve_reference(reference: Any, *, config: ReferenceConfig | None = None,
                      lightning_module: nn.Module | None = None, device: str | torch.device | None = None) -> Any:
    """The ``SamplingClient`` that ``reference`` stands for (see the module docstring).

    ``device`` and the ``config``'s ``scoring_dtype`` and ``max_tokens_per_batch`` apply to the
    local (torch) ways; a client given as it is keeps its own settings.

    Examples:
        >>> import torch
        >>> type(resolve_reference(lambda ids: torch.zeros(*ids.shape, 5))).__name__
        'TorchSamplingClient'
    """
    config = config if config is not None else ReferenceConfig()
    local = {"device": device, "dtype": config.scoring_dtype, "max_tokens_per_batch": config.max_tokens_per_batch}
    if reference is None:
        if lightning_module is None:
            raise ValueError("reference=None means the LightningModule itself, but there is none (no trainer "
                             "attached); pass a SamplingClient, an nn.Module, a callable or a checkpoint path")
        return PolicyReference(lightning_module, device=device, scoring_dtype=config.scoring_dtype,
                               max_tokens_per_batch=config.max_tokens_per_batch)
    if isinstance(reference, (str, os.PathLike)):
        return load_reference_checkpoint(reference, lightning_module, **local)
    if isinstance(reference, nn.Module):
        return TorchSamplingClient.snapshot(reference, **local)
    if isinstance(reference, SamplingClient) or callable(getattr(reference, "compute_logprobs_batch", None)):
        return reference
    if callable(reference):
        return TorchSamplingClient(reference, **local)
    raise TypeError("reference must be a SamplingClient, an nn.Module, a callable fn(input_ids) -> logits, a "
                    f"checkpoint path or None, got {type(reference).__name__}")


def load_reference_checkpoint(path: str | os.PathLike[str], lightning_module: nn.Module | None,
                              **client: Any) -> TorchSamplingClient:
    """A client (``TorchSamplingClient`` with ``client``'s arguments) over a frozen copy of ``lightning_module``
    holding the weights saved at ``path``: a Lightning checkpoint (with ``"state_dict"``) or a state dict, read
    with ``torch.load(weights_only=True)``, whose keys must match the module's exactly."""
    path = os.fspath(path)
    if lightning_module is None:
        raise ValueError(f"reference={path!r}: a checkpoint is loaded into a copy of the LightningModule, but there "
                         "is none (no trainer attached); pass an nn.Module or a SamplingClient instead")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reference checkpoint {path!r} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"reference checkpoint {path!r} holds more than tensors and plain values, so it is not loaded "
            f"(torch.load weights_only=True refused it: {str(error).splitlines()[0]}). Save its state dict alone: "
            f"torch.save(torch.load(path, weights_only=False)['state_dict'], 'reference.pt')"
        ) from None
    state_dict = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, Mapping) else checkpoint
    if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"reference checkpoint {path!r} is neither a Lightning checkpoint (with 'state_dict') nor a "
                         f"state dict of tensors (got {type(state_dict).__name__})")
    scorer = TorchSamplingClient(frozen_copy(lightning_module), **client)
    expected = set(scorer.model.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    try:
        if missing or unexpected:
            raise RuntimeError(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected keys "
                               f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        scorer.model.load_state_dict(state_dict)
    except RuntimeError as error:
        name = type(lightning_module).__name__
        raise ValueError(f"reference checkpoint {path!r} does not fit {name}: {error}") from None
    return scorer
