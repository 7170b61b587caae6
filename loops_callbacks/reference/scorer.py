"""``TokenScorer``: packed token sequences in, one flat float32 tensor of log-probabilities out.

The base of ``TorchSamplingClient`` and ``PolicyReference`` (and ``ScorerClient``, the
``SamplingClient`` list forms of any ``score_packed``, the base of every packed-token client). It calls a causal LM as
``call(input_ids)`` on right-padded batches built on the device (``packing.DeviceBatches``), in
eval mode, without autograd and with the Hugging Face key/value cache off, and gets the
log-probabilities of the target tokens either from the model's output head fed chunk by chunk
(no ``[B, T, V]`` logits) or from its logits (``heads``). The head path is verified once on a
short probe before it is trusted; a model that fails the check is scored on the general path.

*Lock-step* scoring (``lockstep=`` a ``StallGuard``): every rank runs the same number of forward
passes, the ranks with fewer batches running tiny padding batches, and (with a timeout) the ranks
meet before each one, so a model whose forward is a collective (FSDP,
FSDP2) never waits for a rank that has finished or stalled. This is what "lock-step" means
everywhere in this package.

Right padding needs no attention mask: with causal attention a real position only attends to
the positions before it, so a padded row scores as it would alone (up to float rounding).

Examples:
    >>> import torch
    >>> from loops_callbacks.reference.packing import PackedTokens
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    >>> scorer = TokenScorer(model, module=model, device="cpu", max_tokens_per_batch=8)
    >>> values = scorer.score_packed(PackedTokens.from_sequences([[1, 2, 3], [4]]))
    >>> values.shape, float(values[2]), float(values[3]), scorer.path
    (torch.Size([4]), 0.0, 0.0, 'logits')
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.fields import model_input_tokens
from loops_callbacks.logprobs import token_logprobs
from loops_callbacks.distributed import ProcessGroup, StallGuard
from loops_callbacks.reference.heads import OutputHead, find_output_head, model_logits
from loops_callbacks.reference.packing import DeviceBatches, PackedTokens, check_token_ids, plan_batches
from loops_callbacks.validation import check_reference_logprobs

__all__ = ["OutputHeadWarning", "ScorerClient", "TokenScorer", "default_head_rows", "default_tokens_per_batch"]


class OutputHeadWarning(UserWarning):
    """A model exposes an output head, but it cannot be scored from it: full logits are used instead."""

# The default token budget per forward pass (it counts padded tokens, B * T_max), by device type,
# measured with benchmarks/bench_reference.py (512 sequences of 16-512 tokens; scored tokens/s and
# peak memory growth for each budget):
# - CPU (a 2.4M-parameter model with a 4096-token vocabulary; this project's 2-core machine, shared
#   with other work, best of 3 interleaved rounds): 21.5k tokens/s at 512 padded tokens per batch,
#   27.1k at 1024, 27.7k at 2048, 20.7k at 4096, 21.9k at 8192, 19.6k at 16384; batching beyond a
#   few thousand tokens only pushes activations out of cache. A CPU's matrix products are already
#   efficient on one sequence of a few hundred tokens, so batching only has to gather short ones.
# - CUDA (H200; the same model in float32, and a 169M-parameter bfloat16 model with a 32768-token
#   vocabulary): throughput grows up to 16384 padded tokens per batch (the 169M model: 0.61M tok/s
#   at 2048, 0.86M at 8192, 0.92M at 16384, 0.87M at 32768), while the peak doubles with each
#   doubling: 16384 is the top of the plateau.
# Other device types (mps, xpu, ...) get the CPU figure: small and safe until measured.
# On the output-head path a batch holds activations only (the head's logits exist one chunk at a
# time), so the budget does not depend on the vocabulary. On the general path the model's own
# logits (budget x vocabulary in its dtype) dominate: the default is capped at
# _DEFAULT_LOGITS_BYTES of them (16384 tokens at a 32768-token vocabulary, ~3500 at 152k).
_DEFAULT_TOKENS_PER_BATCH: dict[str, int] = {"cpu": 2048, "cuda": 16384}
_DEFAULT_LOGITS_BYTES = 2 << 30
_MIN_DEFAULT_TOKENS_PER_BATCH = 512
# Rows per chunk on the output-head path, by device type: (target bytes of float32 logits, fewest
# rows, most bytes). A chunk exists twice in float32 (logits, log-probabilities). On the CPU a chunk
# that stays in cache scores fastest (2-core EPYC, vocabulary 4096: 256 rows = 4 MiB 20% faster than
# 2048 rows), but each chunk reads the whole head, so a large vocabulary needs enough rows for an
# efficient matrix product (vocabulary 32768: 128 rows 10% slower than 256, 64 rows 25% slower):
# at least 128 rows, at most 64 MiB. On CUDA, 256 MiB and at least 512 rows.
_HEAD_CHUNKS: dict[str, tuple[int, int, int]] = {"cpu": (4 << 20, 128, 64 << 20), "cuda": (256 << 20, 512, 1 << 30)}
_PROBE_TOKENS = 16

Path = Literal["output_head", "logits"]


def default_tokens_per_batch(device: str | torch.device, vocab_size: int | None = None) -> int:
    """The default padded-token budget: measured per device type, capped by full logits' size.

    ``vocab_size`` is given for the general path (where the model's ``[B, T, V]`` logits exist),
    ``None`` on the output-head path (no cap).

    Examples:
        >>> default_tokens_per_batch("cuda"), default_tokens_per_batch("cuda", 151936), default_tokens_per_batch("cpu")
        (16384, 3533, 2048)
    """
    device_type = torch.device(device).type
    budget = _DEFAULT_TOKENS_PER_BATCH.get(device_type, _DEFAULT_TOKENS_PER_BATCH["cpu"])
    if vocab_size:
        budget = min(budget, max(_MIN_DEFAULT_TOKENS_PER_BATCH, _DEFAULT_LOGITS_BYTES // (4 * vocab_size)))
    return budget


def default_head_rows(device: str | torch.device, vocab_size: int) -> int:
    """Rows per chunk on the output-head path (see ``_HEAD_CHUNKS``; at least 1).

    Examples:
        >>> default_head_rows("cpu", 4096), default_head_rows("cpu", 131072), default_head_rows("cuda", 131072)
        (256, 128, 512)
    """
    target, fewest, most = _HEAD_CHUNKS.get(torch.device(device).type, _HEAD_CHUNKS["cpu"])
    row_bytes = 4 * vocab_size
    return max(1, min(max(fewest, target // row_bytes), most // row_bytes))


class ScorerClient:
    """What every packed-token client shares: the ``SamplingClient`` forms of its ``score_packed``.

    A subclass has ``score_packed(packed, *, progress=None, lockstep=None)`` (flat float32 values in
    the ``ref_logprobs`` layout) and ``vocab_size``; ``compute_logprobs`` and
    ``compute_logprobs_batch`` are the SDK's list forms of it.
    """

    vocab_size: int | None
    score_packed: Callable[..., torch.Tensor]

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        """Log-probabilities of ``prompt``'s tokens (a ``ModelInput``, a list of ids or a 1-D tensor); element 0 is
        ``None``."""
        return self.compute_logprobs_batch([prompt])[0]

    def compute_logprobs_batch(self, prompts: Sequence[Any]) -> list[list[float | None]]:
        """``compute_logprobs`` of every prompt, in the caller's order, batched by length.

        Examples:
            >>> client = TokenScorer(torch.nn.Sequential(torch.nn.Embedding(5, 5)), module=None, device="cpu")
            >>> [len(lp) for lp in client.compute_logprobs_batch([[1, 2, 3], [], [4]])]
            [3, 0, 1]
        """
        sequences = []
        for index, prompt in enumerate(prompts):
            try:
                sequences.append(model_input_tokens(prompt))
            except (TypeError, ValueError) as error:
                raise type(error)(f"prompt {index}: {error}") from None
        packed = PackedTokens.from_sequences(sequences)
        values = self.score_packed(packed).cpu().numpy()
        bounds = zip(packed.offsets[:-1].tolist(), packed.offsets[1:].tolist())
        return [[None, *values[start : stop - 1].tolist()] if stop > start else [] for start, stop in bounds]


class TokenScorer(ScorerClient):
    """Scores ``PackedTokens`` with a causal LM; see the module docstring.

    Args:
        call: ``call(input_ids [B, T]) -> logits [B, T, V]`` (or an object with ``.logits``).
        module: the ``nn.Module`` behind ``call`` (eval mode, KV cache off, output head), or ``None``
            for a plain callable (general path only).
        device: where batches are built.
        max_tokens_per_batch: padded tokens per forward; ``None`` for the default of the path.
        output_head: ``True`` to use the model's output head when it has one (verified once),
            ``False`` for the general path.
        vocab_size: for the general path's default budget, when known.
        autocast: a context manager factory entered around every forward (mixed precision).
        grad_mode: ``"inference"`` (``torch.inference_mode``) or ``"no_grad"`` (what FSDP needs).
        head_rows: rows per chunk on the head path (default: ``default_head_rows``).
    """

    def __init__(
        self,
        call: Callable[[torch.Tensor], Any],
        *,
        module: nn.Module | None,
        device: str | torch.device,
        max_tokens_per_batch: int | None = None,
        output_head: bool = True,
        vocab_size: int | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        grad_mode: Literal["inference", "no_grad"] = "inference",
        head_rows: int | None = None,
    ) -> None:
        self.call = call
        self.module = module
        self.device = torch.device(device)
        self.autocast = autocast or contextlib.nullcontext
        self.grad_mode = grad_mode
        self.head: OutputHead | None = None
        self.why_not_head = "output_head=False" if not output_head else "no nn.Module to look into"
        if output_head and module is not None:
            self.head, self.why_not_head = find_output_head(module)
        # a head exposed but refused (an unknown transform, or the check below) is said once, when scoring
        self._tell_fallback = output_head and callable(getattr(module, "get_output_embeddings", None))
        self.vocab_size = vocab_size if vocab_size is not None else (self.head.vocab_size if self.head else None)
        self._explicit_budget = max_tokens_per_batch
        self._verified = self.head is None
        self.head_rows = head_rows

    @property
    def path(self) -> Path:
        """``"output_head"`` or ``"logits"`` (the head path until its one-time check says otherwise)."""
        return "output_head" if self.head is not None else "logits"

    @property
    def max_tokens_per_batch(self) -> int:
        """The padded-token budget of one forward pass (the given one, or the default of the path)."""
        if self._explicit_budget is not None:
            return self._explicit_budget
        return default_tokens_per_batch(self.device, None if self.head is not None else self.vocab_size)

    def score_packed(self, packed: PackedTokens, *, progress: Callable[[int], None] | None = None,
                     lockstep: StallGuard | None = None) -> torch.Tensor:
        """Flat float32 values of every sequence of ``packed`` in the ``ref_logprobs`` layout, on the device: value k
        of a sequence is log p(token k + 1 | tokens up to k), its last value 0.

        The ids are checked against ``vocab_size`` first (``check_token_ids``). ``progress(n)`` is
        told each batch's number of real tokens. With ``lockstep``, call it on every rank of the
        group at the same time. A value that is not a logprob (NaN, infinite, above 0 beyond rounding:
        a NaN weight) is a ``ValueError`` naming the datum (sequence of ``packed``) and position.

        Examples:
            >>> scorer = TokenScorer(torch.nn.Sequential(torch.nn.Embedding(5, 5)), module=None, device="cpu")
            >>> scorer.score_packed(PackedTokens.from_sequences([[1, 2], [3]])).shape
            torch.Size([3])
        """
        check_token_ids(packed, self.vocab_size)
        with self._scoring():
            if not self._verified:
                self._verify()
            if self._tell_fallback and self.head is None:
                run_warnings.warn(
                    f"{type(self.module).__name__} is scored from its full logits, not from its output head in row "
                    f"chunks: {self.why_not_head}. Each batch then holds [B, T, V] logits: lower "
                    "max_tokens_per_batch if memory runs short",
                    OutputHeadWarning,
                )
            self._tell_fallback = False
            order, plan = plan_batches(packed.lengths, self.max_tokens_per_batch)
            guard = lockstep if lockstep is not None else StallGuard(ProcessGroup(local=True), timeout=None)
            # Agreed before the first forward: a rank must not wait in this collective while
            # another is inside a forward's (FSDP's all-gathers).
            guard.arrive("agreeing on the number of lock-step forwards")
            forwards = guard.group.max_int(len(plan))
            batches = DeviceBatches(packed, order, self.device)
            lengths = packed.lengths[order]
            for index, (start, stop) in enumerate(plan):
                ids = batches.input_ids(start, stop, int(lengths[start]))
                guard.before_forward(index, forwards)
                batches.store(start, stop, self._batch_logprobs(ids))
                if progress is not None:
                    progress(int(lengths[start:stop].sum()))
            padding = torch.zeros((1, 2), dtype=torch.long, device=self.device)
            for index in range(len(plan), forwards):
                guard.before_forward(index, forwards)
                self._batch_logprobs(padding)
            values = batches.result()
        try:  # after every lock-step forward: a rank that refuses has not left the others waiting in one
            check_reference_logprobs(values, where=f"{type(self).__name__}'s reference logprobs", lengths=packed.lengths)
        except ValueError as error:
            raise ValueError(f"{error}. The model's forward gave them: a NaN or infinite weight, or an overflow in "
                             "its dtype, makes such values") from None
        return values

    def _batch_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T - 1]`` float32: log p(token k + 1 | tokens up to k) of each row."""
        targets = input_ids[:, 1:]
        with self.autocast():
            if self.head is not None:
                rows = self.head_rows or default_head_rows(self.device, self.head.vocab_size)
                with self.head.capture(targets, rows_per_chunk=rows) as captured:
                    self.call(input_ids)
                assert captured.logprobs is not None
                return captured.logprobs
            output = self.call(input_ids)
            logits = model_logits(output, input_ids)[:, :-1]
            del output  # e.g. a Hugging Face key/value cache: freed before the log-softmax
            return token_logprobs(logits, targets, dtype=torch.float32)

    def _verify(self) -> None:
        """Check the head path once on a short probe (the same forward on every rank); else fall back."""
        assert self.head is not None
        probe = torch.arange(_PROBE_TOKENS, device=self.device).remainder_(self.head.vocab_size)[None]
        with self.autocast():
            why = self.head.verify(self.call, probe)
        self._verified = True
        if why:
            self.why_not_head, self.head = why, None

    @contextlib.contextmanager
    def _scoring(self) -> Iterator[None]:
        """Eval mode (no dropout) and no Hugging Face key/value cache (``config.use_cache = False``) while scoring,
        then every submodule's own mode and config back; no autograd (``no_grad`` outside inference mode for FSDP,
        whose collectives write into its own tensors)."""
        modules = list(self.module.modules()) if self.module is not None else []
        training = [m for m in modules if m.training]
        configs = {id(m.config): m.config for m in modules if getattr(getattr(m, "config", None), "use_cache", 0) is True}
        grad = torch.inference_mode() if self.grad_mode == "inference" else torch.inference_mode(False)
        if self.module is not None:
            self.module.eval()
        for config in configs.values():
            config.use_cache = False
        try:
            with grad, torch.no_grad():
                yield
        finally:
            for module in training:
                module.training = True
            for config in configs.values():
                config.use_cache = True
