"""Turning a ``reference`` setting into a ``SamplingClient``: a client, a module, a callable, a checkpoint, the policy.

``reference`` may be:

- a ``SamplingClient`` (anything with ``compute_logprobs``): used as it is;
- an ``nn.Module`` mapping ``input_ids [B, T]`` to logits ``[B, T, V]``: a frozen copy is scored
  (``TorchSamplingClient.snapshot``), so the module itself is never cast or moved;
- a plain callable ``fn(input_ids) -> logits``: called as it is (``TorchSamplingClient``);
- a path to a Lightning ``.ckpt`` (its ``"state_dict"``) or to a ``torch.save``d state dict of
  the LightningModule: loaded into a frozen copy of the LightningModule;
- ``None``: the LightningModule itself, used in place (``PolicyReference``: no copy). A
  DataModule with ``ReferenceLogprobsMixin`` scores it once the strategy has set it up, before
  the first optimizer step (``PolicyReference.from_trainer``), and never on a resumed run.

The module and checkpoint ways call the (Lightning) module as ``module(input_ids)``, so its
``forward`` must take token ids and return logits (or an object with ``.logits``). A module whose
layers are built in ``configure_model`` has none before the strategy's setup to copy or load a
checkpoint into: give such a module the default reference, a reference module, or a client.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from loops_callbacks.reference.clients import SamplingClient, TorchClientSettings, TorchSamplingClient, frozen_copy
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.policy import PolicyReference

__all__ = ["load_reference_checkpoint", "local_settings", "resolve_reference"]


def resolve_reference(
    reference: Any,
    *,
    config: ReferenceConfig | None = None,
    lightning_module: nn.Module | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """The ``SamplingClient`` that ``reference`` stands for (see the module docstring).

    ``device`` and the ``config``'s ``scoring_dtype`` and ``max_tokens_per_batch`` apply to the
    local (torch) ways; a client given as it is keeps its own settings. A plain callable cannot be
    cast (``scoring_dtype``).

    Example:
        >>> import torch
        >>> type(resolve_reference(lambda ids: torch.zeros(*ids.shape, 5))).__name__
        'TorchSamplingClient'
    """
    config = config if config is not None else ReferenceConfig()
    if reference is None:
        if lightning_module is None:
            raise ValueError(
                "reference=None means the LightningModule itself, but there is none (no trainer attached); "
                "pass a SamplingClient, an nn.Module, a callable or a checkpoint path"
            )
        return PolicyReference(lightning_module, device=device, config=config)
    if isinstance(reference, (str, os.PathLike)):
        return load_reference_checkpoint(reference, lightning_module, config=config, device=device)
    if isinstance(reference, nn.Module):
        return TorchSamplingClient.from_settings(frozen_copy(reference), local_settings(config, device))
    if isinstance(reference, SamplingClient) or callable(getattr(reference, "compute_logprobs_batch", None)):
        return reference
    if callable(reference):
        return TorchSamplingClient.from_settings(reference, local_settings(config, device))
    raise TypeError(
        "reference must be a SamplingClient, an nn.Module, a callable fn(input_ids) -> logits, a checkpoint path "
        f"or None, got {type(reference).__name__}"
    )


def local_settings(config: ReferenceConfig, device: str | torch.device | None = None) -> TorchClientSettings:
    """What a local (torch) reference scores with: ``config``'s ``scoring_dtype`` and ``max_tokens_per_batch``,
    on ``device``.

    Example:
        >>> local_settings(ReferenceConfig(scoring_dtype="bfloat16", max_tokens_per_batch=512), "cpu")
        TorchClientSettings(device=device(type='cpu'), dtype=torch.bfloat16, max_tokens_per_batch=512, output_head=True)
    """
    return TorchClientSettings(
        device=device, dtype=config.scoring_dtype, max_tokens_per_batch=config.max_tokens_per_batch
    )


def load_reference_checkpoint(
    path: str | os.PathLike[str],
    lightning_module: nn.Module | None,
    *,
    config: ReferenceConfig | None = None,
    device: str | torch.device | None = None,
) -> TorchSamplingClient:
    """A client over a frozen copy of ``lightning_module`` holding the weights saved at ``path``.

    ``path`` is a Lightning checkpoint (a dict with ``"state_dict"``) or a state dict; it is read
    with ``torch.load(weights_only=True)`` and must match the module's keys exactly.
    """
    path = os.fspath(path)
    if lightning_module is None:
        raise ValueError(
            f"reference={path!r}: a checkpoint is loaded into a copy of the LightningModule, but there is none "
            "(no trainer attached); pass an nn.Module or a SamplingClient instead"
        )
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
        raise ValueError(
            f"reference checkpoint {path!r} is neither a Lightning checkpoint (with 'state_dict') nor a state dict "
            f"of tensors (got {type(state_dict).__name__})"
        )
    settings = local_settings(config if config is not None else ReferenceConfig(), device)
    client = TorchSamplingClient.from_settings(frozen_copy(lightning_module), settings)
    expected = set(client.model.state_dict())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"reference checkpoint {path!r} does not fit {type(lightning_module).__name__}: "
            f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    try:
        client.model.load_state_dict(state_dict)
    except RuntimeError as error:
        raise ValueError(
            f"reference checkpoint {path!r} does not fit {type(lightning_module).__name__}: {error}"
        ) from None
    return client
