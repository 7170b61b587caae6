"""Reference-model scoring: the ``SamplingClient`` protocol and a local, batched torch scorer.

A *sampling client* answers ``compute_logprobs(prompt)`` with one log-probability per token of
``prompt``: element i is log p(token i | tokens before i), and element 0 is ``None`` (nothing
predicts the first token). Remote clients (Tinker, Baseten Loops) implement it over the network;
``TorchSamplingClient`` implements it over a local frozen causal LM, scoring many prompts per
forward pass.

Example:
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from loops_callbacks.fields import model_input_tokens
from loops_callbacks.reference.collectives import Group
from loops_callbacks.reference.fingerprint import weights_fingerprint
from loops_callbacks.reference.packing import PackedTokens, check_token_ids
from loops_callbacks.reference.scorer import TokenScorer, default_tokens_per_batch
from loops_callbacks.types import ModelInput
from loops_callbacks.validation import check_bool, check_dtype, check_int

__all__ = ["SamplingClient", "TorchClientSettings", "TorchSamplingClient", "check_token_ids", "frozen_copy"]


@runtime_checkable
class SamplingClient(Protocol):
    """Anything that scores the tokens of a prompt under a (reference) model.

    ``compute_logprobs(prompt)`` returns one value per token of ``prompt``: element i is
    log p(token i | tokens before i); element 0 is ``None`` and other elements may be ``None``.
    Tinker's client returns a future instead (resolve it with ``.result()``); both work with
    ``attach_reference_logprobs``. A client may also offer ``compute_logprobs_async(prompt)``
    (a coroutine) and/or ``compute_logprobs_batch(prompts) -> list[list[float | None]]``, which
    ``attach_reference_logprobs`` prefers when present.

    Example:
        >>> class Uniform:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-2.0] * (prompt.length - 1)
        >>> isinstance(Uniform(), SamplingClient)
        True
    """

    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]: ...


def _check_dtype(dtype: Any) -> torch.dtype | None:
    return None if dtype is None else check_dtype("dtype", dtype)


def _check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device={device!r} is not a torch device: {error}") from None


def _check_budget(max_tokens_per_batch: Any) -> int | None:
    return None if max_tokens_per_batch is None else check_int("max_tokens_per_batch", max_tokens_per_batch, least=1)


@dataclass(frozen=True)
class TorchClientSettings:
    """Where and how a ``TorchSamplingClient`` scores, checked once and handed on whole (see its Args).

    ``device`` and ``dtype`` may be given as names; they are kept as ``torch.device`` /
    ``torch.dtype`` (``None``: where and how the model is). A bad value is a ``ValueError`` (or
    ``TypeError``) naming it.

    Example:
        >>> settings = TorchClientSettings(device="cpu", dtype="bfloat16")
        >>> settings.device, settings.dtype, settings.max_tokens_per_batch
        (device(type='cpu'), torch.bfloat16, None)
    """

    device: torch.device | None = None
    dtype: torch.dtype | None = None
    max_tokens_per_batch: int | None = None
    output_head: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _check_device(self.device))
        object.__setattr__(self, "dtype", _check_dtype(self.dtype))
        _check_budget(self.max_tokens_per_batch)
        check_bool("output_head", self.output_head)


def frozen_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` in eval mode with ``requires_grad_(False)``; ``module`` itself is untouched.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> copy_ = frozen_copy(layer)
        >>> copy_ is layer, copy_.training, layer.weight.requires_grad
        (False, False, True)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    frozen = copy.deepcopy(module)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def _module_device(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _module_dtype(module: nn.Module) -> torch.dtype:
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


class ScorerClient:
    """What the clients scored by a ``TokenScorer`` share: its settings and the SDK's list forms.

    A subclass sets ``scorer`` and defines ``score_packed(packed, *, progress, lockstep)`` (flat
    values in the ``ref_logprobs`` layout); ``compute_logprobs`` and ``compute_logprobs_batch``
    are the ``SamplingClient`` forms of it.
    """

    scorer: TokenScorer

    def score_packed(
        self,
        packed: PackedTokens,
        *,
        progress: Callable[[int], None] | None = None,
        lockstep: Any = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    @property
    def max_tokens_per_batch(self) -> int:
        """The padded-token budget of one forward pass (the given one, or the default of the path)."""
        return self.scorer.max_tokens_per_batch

    @property
    def path(self) -> str:
        """``"output_head"`` (chunked, from hidden states) or ``"logits"`` (the general path)."""
        return self.scorer.path

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        """Log-probabilities of ``prompt``'s tokens; element 0 is ``None``.

        ``prompt`` is a ``ModelInput`` (ours, Tinker's or Loops'), a list of ids or a 1-D tensor.

        Example:
            >>> import torch
            >>> client = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(5, 5)))
            >>> client.compute_logprobs([1, 2])[0] is None
            True
        """
        return self.compute_logprobs_batch([prompt])[0]

    def compute_logprobs_batch(self, prompts: Sequence[Any]) -> list[list[float | None]]:
        """``compute_logprobs`` of every prompt, in the caller's order, batched by length.

        The SDK's list form; ``score_packed`` is the same without lists.

        Example:
            >>> import torch
            >>> client = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(5, 5)))
            >>> [len(lp) for lp in client.compute_logprobs_batch([[1, 2, 3], [], [4]])]
            [3, 0, 1]
        """
        packed = PackedTokens.from_sequences([self._tokens(prompt, index) for index, prompt in enumerate(prompts)])
        values = self.score_packed(packed).cpu().numpy()
        results: list[list[float | None]] = []
        for index in range(len(packed)):
            start, stop = int(packed.offsets[index]), int(packed.offsets[index + 1])
            results.append([None, *values[start : stop - 1].tolist()] if stop > start else [])
        return results

    def _tokens(self, prompt: Any, index: int) -> list[int]:
        try:
            return model_input_tokens(prompt)
        except (TypeError, ValueError) as error:
            raise TypeError(f"prompt {index}: {error}") from None


class TorchSamplingClient(ScorerClient):
    """A ``SamplingClient`` over a local causal LM, scoring many prompts per forward pass.

    ``model`` is an ``nn.Module`` that maps token ids ``LongTensor[B, T]`` to logits ``[B, T, V]``
    (or returns an object with ``.logits``, as Hugging Face models do), or a plain callable
    ``fn(input_ids) -> logits``. It is called as ``model(input_ids)`` and nothing else: prompts
    are right-padded, and with causal attention a real position only attends to positions
    before it, never to the padding after the end of its row, so no attention mask is needed and
    a padded row scores exactly as it would alone (up to float rounding of differently shaped
    matrix products).

    Prompts are packed once into flat arrays, sorted by length and cut into batches of at most
    ``max_tokens_per_batch`` padded tokens (rows x longest row; a prompt longer than the budget
    gets a batch of its own); the batches are built on the device and scored in eval mode under
    ``torch.inference_mode()``, and the results stay one device tensor until the end
    (``loops_callbacks.reference.scorer``). A module that exposes its output head (Hugging Face's
    ``get_output_embeddings()``) is scored from its final hidden states a chunk of rows at a time,
    never holding its ``[B, T, V]`` logits (``loops_callbacks.reference.heads``); other models and
    callables take the general path (their logits, turned into float32 log-probabilities a few
    rows at a time).

    The model is used in place, not copied: ``device`` / ``dtype`` move or cast it like
    ``module.to`` (``None`` keeps where and how it is). Use ``snapshot`` for a frozen copy.

    Args:
        model: the causal LM (an ``nn.Module``) or a callable ``fn(input_ids) -> logits``.
        device: where to score (default: where the model's parameters are; the CPU for a callable).
        dtype: cast the model to this floating dtype (``torch.bfloat16`` or ``"bfloat16"``, ...);
            not for a callable.
        max_tokens_per_batch: padded-token budget of one forward pass; default by device type
            (2048 on CPU, 16384 on CUDA; on the general path fewer for a vocabulary over 32768
            tokens; see ``loops_callbacks.reference.scorer``).
        output_head: score from the output head when the model exposes one (``False``: always
            the model's logits).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
        >>> client = TorchSamplingClient(model, max_tokens_per_batch=64)
        >>> [len(lp) for lp in client.compute_logprobs_batch([[1, 2, 3], [4], [5, 6]])]
        [3, 1, 2]
        >>> uniform = TorchSamplingClient(lambda ids: torch.zeros(*ids.shape, 4))
        >>> [round(v, 4) for v in uniform.compute_logprobs([1, 2])[1:]]
        [-1.3863]
    """

    def __init__(
        self,
        model: nn.Module | Callable[[torch.Tensor], Any],
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_tokens_per_batch: int | None = None,
        output_head: bool = True,
    ) -> None:
        _check_model(model)
        settings = TorchClientSettings(
            device=device, dtype=dtype, max_tokens_per_batch=max_tokens_per_batch, output_head=output_head
        )
        self._set_up(model, settings)

    @classmethod
    def from_settings(
        cls, model: nn.Module | Callable[[torch.Tensor], Any], settings: TorchClientSettings
    ) -> TorchSamplingClient:
        """The client over ``model`` (used in place) with ``settings`` made and checked already.

        Example:
            >>> import torch
            >>> settings = TorchClientSettings(max_tokens_per_batch=64)
            >>> client = TorchSamplingClient.from_settings(torch.nn.Sequential(torch.nn.Embedding(5, 5)), settings)
            >>> client.settings is settings, client.max_tokens_per_batch
            (True, 64)
        """
        if not isinstance(settings, TorchClientSettings):
            raise TypeError(
                f"settings must be a TorchClientSettings, got {type(settings).__name__} (make one with "
                "TorchClientSettings(...), or use TorchSamplingClient(model, ...))"
            )
        _check_model(model)
        client = cls.__new__(cls)
        client._set_up(model, settings)
        return client

    def _set_up(self, model: nn.Module | Callable[[torch.Tensor], Any], settings: TorchClientSettings) -> None:
        is_module = isinstance(model, nn.Module)
        if not is_module and settings.dtype is not None:
            raise ValueError(
                f"dtype={str(settings.dtype).removeprefix('torch.')!r} cannot cast a plain callable reference; cast "
                "its model yourself, or pass the nn.Module"
            )
        if is_module and (settings.device is not None or settings.dtype is not None):
            model.to(device=settings.device, dtype=settings.dtype)
        self.model = model
        self.settings = settings
        if is_module:
            self.device = settings.device if settings.device is not None else _module_device(model)
            self.dtype: torch.dtype | None = settings.dtype if settings.dtype is not None else _module_dtype(model)
            self.vocab_size = _find_vocab_size(model)
        else:
            self.device = settings.device if settings.device is not None else torch.device("cpu")
            self.dtype = None
            self.vocab_size = None
        self.scorer = TokenScorer(
            model,
            model=model if is_module else None,
            device=self.device,
            max_tokens_per_batch=settings.max_tokens_per_batch,
            output_head=settings.output_head,
            vocab_size=self.vocab_size,
        )

    @staticmethod
    def default_tokens_per_batch(device: str | torch.device, vocab_size: int | None = None) -> int:
        """The default ``max_tokens_per_batch``: measured per device type, capped by full logits' size.

        2048 on CPU and other devices, 16384 on CUDA; with a ``vocab_size`` (the general path, where
        the model's logits exist), at most what keeps one batch's float32 logits within 2 GiB
        (and never below 512). The output-head path passes no ``vocab_size``.

        Example:
            >>> TorchSamplingClient.default_tokens_per_batch("cuda"), TorchSamplingClient.default_tokens_per_batch("cuda", 151936)
            (16384, 3533)
        """
        return default_tokens_per_batch(device, vocab_size)

    @classmethod
    def snapshot(
        cls,
        module: nn.Module,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_tokens_per_batch: int | None = None,
        output_head: bool = True,
    ) -> TorchSamplingClient:
        """A client over a frozen deep copy of ``module``, pinned to its weights of now.

        The copy is in eval mode with ``requires_grad_(False)``, cast/moved to ``dtype`` /
        ``device`` when given; later training of ``module`` does not change it, and ``module``
        itself is untouched. The local analogue of Tinker's ``save_weights_and_get_sampling_client``.
        It costs a second copy of the weights: the default reference of ``DPODataModule`` is the
        policy itself instead (``loops_callbacks.reference.policy``). The keywords are checked once,
        as one ``TorchClientSettings``, before the copy is made: ``from_settings(frozen_copy(module), settings)``.

        Example:
            >>> import torch
            >>> policy = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
            >>> reference = TorchSamplingClient.snapshot(policy, dtype="float64")
            >>> reference.model is policy, reference.dtype, next(policy.parameters()).dtype
            (False, torch.float64, torch.float32)
        """
        settings = TorchClientSettings(
            device=device, dtype=dtype, max_tokens_per_batch=max_tokens_per_batch, output_head=output_head
        )  # checked before the copy
        return cls.from_settings(frozen_copy(module), settings)

    def __repr__(self) -> str:
        name = type(self.model).__name__ if isinstance(self.model, nn.Module) else getattr(self.model, "__name__", "callable")
        return (
            f"{type(self).__name__}({name}, device={str(self.device)!r}, dtype={self.dtype}, "
            f"max_tokens_per_batch={self.max_tokens_per_batch}, vocab_size={self.vocab_size}, path={self.path!r})"
        )

    def fingerprint(self) -> str | None:
        """A sha256 hex digest of the scoring model's weights and dtype (``None`` for a callable).

        It covers the model's class name and every parameter and buffer (name, dtype, shape,
        bytes), so it is equal for equal weights in any process and changes when any weight does
        (``loops_callbacks.reference.fingerprint``). It reads every weight: a cache key, not a
        per-step check. A plain callable has no weights to read: give ``reference_fingerprint``
        to cache its results.

        Example:
            >>> import torch
            >>> client = TorchSamplingClient(torch.nn.Linear(2, 2))
            >>> len(client.fingerprint())
            64
        """
        if not isinstance(self.model, nn.Module):
            return None
        return weights_fingerprint(self.model, tag=str(self.dtype), group=Group.local())

    def score_packed(
        self,
        packed: PackedTokens,
        *,
        progress: Callable[[int], None] | None = None,
        lockstep: Any = None,
    ) -> torch.Tensor:
        """Flat float32 values of every sequence of ``packed`` in the ``ref_logprobs`` layout, on the device.

        Value k of a sequence is log p(token k + 1 | tokens up to k); its last value is 0.

        Example:
            >>> import torch
            >>> from loops_callbacks.reference.packing import PackedTokens, check_token_ids
            >>> client = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(5, 5)))
            >>> client.score_packed(PackedTokens.from_sequences([[1, 2], [3]])).shape
            torch.Size([3])
        """
        check_token_ids(packed, self.vocab_size)
        return self.scorer.score(packed, progress=progress, lockstep=lockstep)


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(
            f"model must be a torch.nn.Module or a callable fn(input_ids) -> logits, got {type(model).__name__}"
        )


def _find_vocab_size(model: nn.Module) -> int | None:
    """The output vocabulary size, from the first of: ``config.vocab_size``,
    ``get_output_embeddings().out_features``, a ``vocab_size`` attribute, the last ``nn.Linear``."""
    config_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(config_size, int) and not isinstance(config_size, bool):
        return config_size
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    if callable(get_output_embeddings):
        head = get_output_embeddings()
        if isinstance(getattr(head, "out_features", None), int):
            return head.out_features
    size = getattr(model, "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None
