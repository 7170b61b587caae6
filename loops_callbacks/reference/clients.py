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
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from loops_callbacks.fields import model_input_tokens
from loops_callbacks.types import ModelInput

__all__ = ["SamplingClient", "TorchSamplingClient"]


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


# The default token budget per forward pass (it counts padded tokens, B * T_max), by device type,
# measured with benchmarks/bench_reference.py (512 sequences of 16-512 tokens; scored tokens/s and
# peak memory growth for each budget):
# - CPU (a 2.4M-parameter model with a 4096-token vocabulary; this project's 2-core machine, shared
#   with other work, best of 3 interleaved rounds): 21.5k tokens/s at 512 padded tokens per batch,
#   27.1k at 1024, 27.7k at 2048, 20.7k at 4096, 21.9k at 8192, 19.6k at 16384 (on 2 threads of an
#   idle 16-core host: 31k, 27k, 30k, 27k, 23k, 24k); batching beyond a few thousand tokens only
#   pushes activations and logits out of cache. The peak grows linearly with the budget (+25 MiB at
#   512, +65 MiB at 2048, +161 MiB at 8192, +306 MiB at 16384; the float32 logits alone take
#   budget x vocab x 4 bytes). A CPU's matrix products are already efficient on one sequence of a
#   few hundred tokens, so batching only has to gather short ones: 2048 is the measured best at a
#   small, bounded peak.
# - CUDA (H200; the same model in float32, and a 169M-parameter bfloat16 model with a 32768-token
#   vocabulary): throughput grows up to 16384 padded tokens per batch (the small model: 0.53M tok/s
#   at 1024, 1.4M at 4096, 2.4M at 16384 and 32768, 2.0M at 65536; the 169M model: 0.61M at 2048,
#   0.86M at 8192, 0.92M at 16384, 0.87M at 32768, 0.78M at 65536), while the peak doubles with
#   each doubling (+1.2 GiB at 16384 for the 169M model): 16384 is the top of the plateau.
# Other device types (mps, xpu, ...) get the CPU figure: small and safe until measured.
# The logits dominate the peak (budget x vocabulary), so the default is further capped at
# _DEFAULT_LOGITS_BYTES of float32 logits when the vocabulary is known: 16384 tokens at a 32768-token
# vocabulary (the measured plateau), ~3500 at 152k (Qwen), where models big enough to have such a
# vocabulary already fill a GPU with fewer tokens per batch.
_DEFAULT_TOKENS_PER_BATCH: dict[str, int] = {"cpu": 2048, "cuda": 16384}
_DEFAULT_LOGITS_BYTES = 2 << 30
_MIN_DEFAULT_TOKENS_PER_BATCH = 512
# Rows of logits turned into float32 log-probabilities at a time, at most this many elements
# (16 MiB of float32; at least one row): the float32 temporaries stay small next to the model's
# own [B, T, V] output, so a batch's peak is about its logits, not twice them.
_LOGSOFTMAX_CHUNK_ELEMENTS = 1 << 22

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") in _DTYPES:
            return _DTYPES[dtype.removeprefix("torch.")]
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype={dtype!r} is not a floating-point torch.dtype or one of {sorted(_DTYPES)}")


def _check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device={device!r} is not a torch device: {error}") from None


def _check_budget(max_tokens_per_batch: Any) -> int | None:
    if max_tokens_per_batch is None:
        return None
    if isinstance(max_tokens_per_batch, bool) or not isinstance(max_tokens_per_batch, int):
        raise TypeError(f"max_tokens_per_batch={max_tokens_per_batch!r} must be an int or None")
    if max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch={max_tokens_per_batch!r} must be at least 1")
    return max_tokens_per_batch


def _module_device(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _module_dtype(module: nn.Module) -> torch.dtype:
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Run in eval mode (no dropout), then give every submodule its own mode back."""
    training = [m for m in module.modules() if m.training]
    module.eval()
    try:
        yield
    finally:
        for m in training:
            m.training = True


class TorchSamplingClient:
    """A ``SamplingClient`` over a local causal LM, scoring many prompts per forward pass.

    ``model`` is any ``nn.Module`` that maps token ids ``LongTensor[B, T]`` to logits
    ``[B, T, V]`` (or returns an object with ``.logits``, as Hugging Face models do). It is called
    as ``model(input_ids)`` and nothing else: prompts are right-padded, and with causal attention
    a real position only attends to positions before it, never to the padding after the end of
    its row, so no attention mask is needed and a padded row scores exactly as it would alone
    (up to float rounding of differently shaped matrix products).

    ``compute_logprobs_batch`` sorts the prompts by length, packs them into batches of at most
    ``max_tokens_per_batch`` padded tokens (rows x longest row; a prompt longer than the budget
    gets a batch of its own), runs one forward per batch under ``torch.inference_mode()`` in eval
    mode, and gathers each target token's log-probability from a float32 log-softmax computed a
    few rows at a time, so no more than the model's own ``[B, T, V]`` output is held per batch.

    The model is used in place, not copied: ``device`` / ``dtype`` move or cast it like
    ``module.to`` (``None`` keeps where and how it is). Use ``snapshot`` for a frozen copy.

    Args:
        model: the causal LM.
        device: where to score (default: where the model's parameters are).
        dtype: cast the model to this floating dtype (``torch.bfloat16`` or ``"bfloat16"``, ...).
        max_tokens_per_batch: padded-token budget of one forward pass; default by device type
            (2048 on CPU, 16384 on CUDA, fewer for a vocabulary over 32768 tokens; see
            ``default_tokens_per_batch`` and the measurements in this module's source).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
        >>> client = TorchSamplingClient(model, max_tokens_per_batch=64)
        >>> [len(lp) for lp in client.compute_logprobs_batch([[1, 2, 3], [4], [5, 6]])]
        [3, 1, 2]
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_tokens_per_batch: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        target_device = _check_device(device)
        target_dtype = _check_dtype(dtype)
        budget = _check_budget(max_tokens_per_batch)
        if target_device is not None or target_dtype is not None:
            model.to(device=target_device, dtype=target_dtype)
        self.model = model
        self.device = target_device if target_device is not None else _module_device(model)
        self.dtype = target_dtype if target_dtype is not None else _module_dtype(model)
        self.vocab_size = _find_vocab_size(model)
        self.max_tokens_per_batch = budget if budget is not None else self.default_tokens_per_batch(self.device, self.vocab_size)

    @staticmethod
    def default_tokens_per_batch(device: str | torch.device, vocab_size: int | None = None) -> int:
        """The default ``max_tokens_per_batch``: measured per device type, capped by the logits' size.

        2048 on CPU and other devices, 16384 on CUDA; with a known ``vocab_size``, at most what keeps
        one batch's float32 logits within 2 GiB (and never below 512).

        Example:
            >>> TorchSamplingClient.default_tokens_per_batch("cuda"), TorchSamplingClient.default_tokens_per_batch("cuda", 151936)
            (16384, 3533)
        """
        device_type = torch.device(device).type
        budget = _DEFAULT_TOKENS_PER_BATCH.get(device_type, _DEFAULT_TOKENS_PER_BATCH["cpu"])
        if vocab_size:
            budget = min(budget, max(_MIN_DEFAULT_TOKENS_PER_BATCH, _DEFAULT_LOGITS_BYTES // (4 * vocab_size)))
        return budget

    @classmethod
    def snapshot(
        cls,
        module: nn.Module,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_tokens_per_batch: int | None = None,
    ) -> TorchSamplingClient:
        """A client over a frozen deep copy of ``module``, pinned to its weights of now.

        The copy is in eval mode with ``requires_grad_(False)``, cast/moved to ``dtype`` /
        ``device`` when given; later training of ``module`` does not change it, and ``module``
        itself is untouched. The local analogue of Tinker's ``save_weights_and_get_sampling_client``.
        Pass the bare ``nn.Module`` (e.g. ``pl_module.model``), not a whole ``LightningModule``.

        Example:
            >>> import torch
            >>> policy = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
            >>> reference = TorchSamplingClient.snapshot(policy, dtype="float64")
            >>> reference.model is policy, reference.dtype, next(policy.parameters()).dtype
            (False, torch.float64, torch.float32)
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        target_device = _check_device(device)
        target_dtype = _check_dtype(dtype)
        _check_budget(max_tokens_per_batch)
        frozen = copy.deepcopy(module)
        frozen.eval()
        frozen.requires_grad_(False)
        return cls(frozen, device=target_device, dtype=target_dtype, max_tokens_per_batch=max_tokens_per_batch)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.model).__name__}, device={str(self.device)!r}, "
            f"dtype={self.dtype}, max_tokens_per_batch={self.max_tokens_per_batch}, "
            f"vocab_size={self.vocab_size})"
        )

    def fingerprint(self) -> str:
        """A sha256 hex digest of the scoring model's weights and the scoring dtype.

        It covers the model's class name and every parameter and buffer (name, dtype, shape,
        bytes), so it is equal for equal weights in any process and changes when any weight does.
        It reads every weight (one pass over the model); use it as a cache key, not per step.

        Example:
            >>> import torch
            >>> client = TorchSamplingClient(torch.nn.Linear(2, 2))
            >>> len(client.fingerprint())
            64
        """
        digest = hashlib.sha256()
        model_class = type(self.model)
        digest.update(f"{model_class.__module__}.{model_class.__qualname__}|{self.dtype}\n".encode())
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        for name, tensor in named:
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}|{data.dtype}|{tuple(tensor.shape)}\n".encode())
            digest.update(memoryview(data.view(torch.uint8).numpy()))
        return digest.hexdigest()

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

        Example:
            >>> import torch
            >>> client = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(5, 5)))
            >>> [len(lp) for lp in client.compute_logprobs_batch([[1, 2, 3], [], [4]])]
            [3, 0, 1]
        """
        token_lists = [self._tokens(prompt, index) for index, prompt in enumerate(prompts)]
        results: list[list[float | None]] = [[None] * min(len(t), 1) for t in token_lists]
        # Prompts of 0 or 1 tokens predict nothing; the longest go first, so the largest batch
        # (and the peak memory) comes at once rather than after minutes of scoring.
        order = sorted((i for i, t in enumerate(token_lists) if len(t) > 1), key=lambda i: -len(token_lists[i]))
        scored: list[tuple[list[int], torch.Tensor]] = []
        with torch.inference_mode(), _eval_mode(self.model):
            for batch in self._pack(order, [len(t) for t in token_lists]):
                scored.append((batch, self._batch_logprobs([token_lists[i] for i in batch])))
        # Copied to the host only now: on a GPU every batch is queued without waiting for the one
        # before (no per-batch synchronisation), and the [B, T-1] results are small.
        for batch, logprobs in scored:
            for i, row in zip(batch, logprobs.cpu().tolist()):
                results[i] = [None, *row[: len(token_lists[i]) - 1]]
        return results

    def _tokens(self, prompt: Any, index: int) -> list[int]:
        try:
            tokens = model_input_tokens(prompt)
        except (TypeError, ValueError) as error:
            raise TypeError(f"prompt {index}: {error}") from None
        if tokens and self.vocab_size is not None:
            low, high = min(tokens), max(tokens)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"prompt {index}: token id {bad} is outside the model's vocabulary [0, {self.vocab_size})"
                )
        return tokens

    def _pack(self, order: list[int], lengths: list[int]) -> Iterator[list[int]]:
        """Consecutive runs of ``order`` (longest first) whose rows x longest row fit the budget."""
        batch: list[int] = []
        for i in order:
            longest = lengths[batch[0]] if batch else lengths[i]
            if batch and (len(batch) + 1) * longest > self.max_tokens_per_batch:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _batch_logprobs(self, token_lists: list[list[int]]) -> torch.Tensor:
        """``out[b, k]`` = log p(token k+1 | tokens up to k) of row b, float32, on the device."""
        width = max(len(t) for t in token_lists)
        input_ids = torch.zeros((len(token_lists), width), dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if self.device.type == "cuda":
            input_ids = input_ids.pin_memory().to(self.device, non_blocking=True)
        else:
            input_ids = input_ids.to(self.device)
        logits = self._logits(input_ids)[:, :-1]
        targets = input_ids[:, 1:].unsqueeze(-1)
        rows_per_chunk = max(1, _LOGSOFTMAX_CHUNK_ELEMENTS // ((width - 1) * logits.shape[-1]))
        parts = []
        for start in range(0, logits.shape[0], rows_per_chunk):
            # One fused kernel reads the logits in their dtype and writes float32 log-probabilities.
            logprobs = torch.log_softmax(logits[start : start + rows_per_chunk], dim=-1, dtype=torch.float32)
            parts.append(logprobs.gather(-1, targets[start : start + rows_per_chunk]).squeeze(-1))
            del logprobs
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids)
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
        del output  # e.g. a Hugging Face key/value cache: free it before the log-softmax
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(
                f"the model returned logits of shape {tuple(logits.shape)} for input_ids of shape "
                f"{tuple(input_ids.shape)}; expected [B, T, V] = [{input_ids.shape[0]}, {input_ids.shape[1]}, V]"
            )
        return logits


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
