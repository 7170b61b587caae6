"""Token sequences packed once into flat arrays, and the padded batches cut from them on the device.

``PackedTokens`` holds every sequence's ids back to back (``ids``, int64) and where each one
starts (``offsets``, ``N + 1`` values): one conversion from Python lists, then only array work.
``plan_batches`` orders the sequences longest first and cuts consecutive runs whose padded size
(rows x longest row) fits a token budget. ``DeviceBatches`` moves the arrays to the device once,
builds each padded ``[B, T]`` batch there with index arithmetic, and scatters each batch's
log-probabilities into one flat float32 tensor in the ``ref_logprobs`` layout: value k of a
sequence is log p(token k + 1 | tokens up to k), and its last value is 0 (nothing is predicted
there). No Python list and no host synchronisation stands between two batches.

Examples:
    >>> packed = PackedTokens.from_sequences([[5, 6, 7], [8], [9, 10]])
    >>> packed.ids.tolist(), packed.offsets.tolist(), packed.lengths.tolist()
    ([5, 6, 7, 8, 9, 10], [0, 3, 4, 6], [3, 1, 2])
    >>> order, batches = plan_batches(packed.lengths, max_tokens_per_batch=4)
    >>> order.tolist(), batches
    ([0, 2], [(0, 1), (1, 2)])
    >>> device_batches = DeviceBatches(packed, order, "cpu")
    >>> device_batches.input_ids(0, 2, width=3).tolist()
    [[5, 6, 7], [9, 10, 0]]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = [
    "CheckedTokens",
    "DeviceBatches",
    "OutOfVocabularyError",
    "PackedTokens",
    "check_token_ids",
    "plan_batches",
    "to_device",
]


@dataclass(frozen=True)
class PackedTokens:
    """Sequences of token ids, back to back: sequence i is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]]) -> PackedTokens:
        """Pack lists (or 1-D arrays) of ids; the only step that reads Python ints one by one.

        Examples:
            >>> PackedTokens.from_sequences([]).offsets.tolist()
            [0]
        """
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        if len(sequences) and all(isinstance(s, np.ndarray) for s in sequences):
            ids = np.concatenate(sequences).astype(np.int64, copy=False) if total else np.zeros(0, np.int64)
        else:
            ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=total)
        return cls(ids, offsets)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1] - self.offsets[0])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def slice(self, start: int, stop: int) -> PackedTokens:
        """Sequences ``start`` to ``stop`` (views, no copy of the ids).

        Examples:
            >>> PackedTokens.from_sequences([[1], [2, 3], [4]]).slice(1, 3).ids.tolist()
            [2, 3, 4]
        """
        offsets = self.offsets[start : stop + 1]
        return replace(self, ids=self.ids[offsets[0] : offsets[-1]], offsets=offsets - offsets[0])


@dataclass(frozen=True)
class CheckedTokens(PackedTokens):
    """``PackedTokens`` whose ids ``check_token_ids`` found inside ``[0, vocab_size)`` (``None``: only
    that none is negative); its slices stay checked, so a scorer does not read the ids again."""

    vocab_size: int | None = None

    def covers(self, vocab_size: int | None) -> bool:
        """Whether the ids are known to lie inside ``[0, vocab_size)``.

        Examples:
            >>> checked = CheckedTokens(np.array([1, 2]), np.array([0, 2]), vocab_size=8)
            >>> checked.covers(8), checked.covers(16), checked.covers(None), checked.covers(4)
            (True, True, True, False)
        """
        return vocab_size is None or (self.vocab_size is not None and self.vocab_size <= vocab_size)


class OutOfVocabularyError(ValueError):
    """A token id outside the vocabulary: sequence ``index``, ``position`` in it, the ``token``.

    ``pair`` is ``index // 2``: the pair of interleaved DPO data (chosen at even indices, rejected at odd).
    """

    def __init__(self, message: str, *, index: int, position: int, token: int) -> None:
        super().__init__(message)
        self.index, self.position, self.token = index, position, token

    @property
    def pair(self) -> int:
        return self.index // 2


def check_token_ids(
    packed: PackedTokens, vocab_size: int | None, *, datum_name: Callable[[int], str] | None = None
) -> CheckedTokens:
    """``packed`` as ``CheckedTokens``, or an ``OutOfVocabularyError`` naming the first sequence holding
    an id outside ``[0, vocab_size)`` (with ``vocab_size=None`` only negative ids are rejected).

    The one token-id check: vectorized over the flat ids, and skipped for ``CheckedTokens`` already
    checked against this vocabulary (``score_across_ranks`` checks once; the scorers then do not).
    The sequence is named ``datum_name(index)`` (default ``prompt <index>``), with the id's position.

    Examples:
        >>> checked = check_token_ids(PackedTokens.from_sequences([[1, 2], [3, 8]]), 9)
        >>> check_token_ids(checked, 9) is checked
        True
        >>> try:
        ...     check_token_ids(PackedTokens.from_sequences([[1, 2], [3, 9]]), 9)
        ... except OutOfVocabularyError as error:
        ...     print(error, (error.index, error.position, error.token))
        prompt 1 has token id 9 at position 1, outside the reference's vocabulary [0, 9) (1, 1, 9)
    """
    if isinstance(packed, CheckedTokens) and packed.covers(vocab_size):
        return packed
    bad = _outside_vocabulary(packed.ids[packed.offsets[0] : packed.offsets[-1]], vocab_size)
    if bad.any():
        flat = int(np.argmax(bad)) + int(packed.offsets[0])
        index = int(np.searchsorted(packed.offsets, flat, side="right")) - 1
        position, token = flat - int(packed.offsets[index]), int(packed.ids[flat])
        name = datum_name(index) if datum_name is not None else f"prompt {index}"
        vocabulary = f"the reference's vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, inf)"
        raise OutOfVocabularyError(f"{name} has token id {token} at position {position}, outside {vocabulary}",
                                   index=index, position=position, token=token)
    return CheckedTokens(packed.ids, packed.offsets, vocab_size=vocab_size)


def _outside_vocabulary(ids: np.ndarray, vocab_size: int | None) -> np.ndarray:
    """Which ids lie outside ``[0, vocab_size)`` (the one pass over the ids that checks them)."""
    bad = ids < 0
    if vocab_size is not None:
        bad |= ids >= vocab_size
    return bad


def plan_batches(lengths: np.ndarray, max_tokens_per_batch: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The sequences worth a forward (2 tokens or more), longest first, and the batches cut from them.

    Returns ``order`` (sequence indices) and ``[(start, stop), ...]`` ranges of ``order``: each
    batch has ``budget // longest`` rows (at least one), so rows x longest row fits the budget,
    and the largest batch comes first (the peak memory shows at once, not after hours).
    """
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] > 1]
    sorted_lengths = lengths[order]
    batches: list[tuple[int, int]] = []
    start = 0
    while start < len(order):
        rows = max(1, max_tokens_per_batch // int(sorted_lengths[start]))
        batches.append((start, min(start + rows, len(order))))
        start += rows
    return order, batches


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """One host-to-device copy; from pinned memory and without blocking the host on CUDA."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class DeviceBatches:
    """The packed ids on the device, padded batches built there, results scattered into one tensor.

    ``values`` has one float32 slot per token plus a last slot that absorbs the padding's
    results; ``result()`` is the ``ref_logprobs`` layout of every sequence, back to back.
    """

    def __init__(self, packed: PackedTokens, order: np.ndarray, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.total = packed.num_tokens
        self.ids = to_device(packed.ids, self.device)
        self.starts = to_device(packed.offsets[:-1], self.device)
        self.lengths = to_device(packed.lengths, self.device)
        self.order = to_device(order.astype(np.int64, copy=False), self.device)
        self.values = torch.zeros(self.total + 1, dtype=torch.float32, device=self.device)
        self._positions: dict[int, torch.Tensor] = {}

    def _arange(self, width: int) -> torch.Tensor:
        if width not in self._positions:
            self._positions[width] = torch.arange(width, device=self.device)
        return self._positions[width]

    def _rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.order[start:stop]
        return self.starts[rows], self.lengths[rows]

    def input_ids(self, start: int, stop: int, width: int) -> torch.Tensor:
        """``[stop - start, width]`` ids of the batch, right-padded with 0."""
        starts, lengths = self._rows(start, stop)
        positions = self._arange(width)
        index = (starts[:, None] + positions).clamp_(max=max(self.total - 1, 0))
        return torch.where(positions < lengths[:, None], self.ids[index], 0)

    def store(self, start: int, stop: int, logprobs: torch.Tensor) -> None:
        """Scatter ``logprobs[b, k]`` (= log p(token k + 1)) into the rows' slots; padding goes to the sink."""
        starts, lengths = self._rows(start, stop)
        positions = self._arange(logprobs.shape[1])
        destination = torch.where(positions < (lengths - 1)[:, None], starts[:, None] + positions, self.total)
        self.values.index_put_((destination.reshape(-1),), logprobs.reshape(-1).to(torch.float32))

    def result(self) -> torch.Tensor:
        """The flat float32 values of every sequence (on the device)."""
        return self.values[: self.total]
