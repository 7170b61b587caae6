"""``PackedPairs``: interleaved DPO sequences back to back in flat arrays, the one form from tokenization to the batches.

Sequence i (pair i // 2; chosen at even i, rejected at odd) is ``[offsets[i], offsets[i + 1])`` of
``input_ids`` and ``target_tokens`` (int64), ``weights`` and ``ref_logprobs`` (float32). Records are
tokenized straight into it (``preference_pairs``); datums are read into it once (``from_datums``:
each field checked, the datum named), and kept as its ``source``, so that ``datums()`` gives them
back with the reference values attached and every field of theirs kept. Values that are views of
one buffer (as scoring gives them) are kept as that buffer, not copied. ``row(i)`` gives sequence
i's tensors as views, which batches are cut from. Pairs are *scored* once they hold their reference
logprobs (``ref_logprobs``; ``scored()``, ``ReferenceLogprobsMixin.scored_pairs``): "scored" means that
everywhere in ``loops_callbacks.data``.

Examples:
    >>> from loops_callbacks.data.dpo import dpo_pair_datums
    >>> pairs = PackedPairs.from_datums(dpo_pair_datums([1, 2, 3], [1, 4], prompt_length=1))
    >>> pairs = pairs.scored(np.array([-0.5, -0.5, 0.0, -1.0, 0.0], dtype=np.float32))
    >>> pairs.offsets.tolist(), pairs.row(1)["target_tokens"].tolist(), pairs.row(0)["ref_logprobs"].tolist()
    ([0, 3, 5], [4, 0], [-0.5, -0.5, 0.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from loops_callbacks.data.sources import datum_label
from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, field_to_tensor, model_input_tokens
from loops_callbacks.reference.attach import reference_field, with_ref_logprobs
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.types import Datum, ModelInput, TensorData

__all__ = ["FIELDS", "PackedPairs"]

FIELDS = {"input_ids": np.int64, "target_tokens": np.int64, "weights": np.float32, "ref_logprobs": np.float32}
"""The per-token fields of a pair's sequences and their dtypes, as batches hold them (the one table)."""


@dataclass(frozen=True, eq=False)
class PackedPairs:
    """Interleaved DPO sequences back to back (see the module docstring).

    ``ref_logprobs`` is ``None`` until scored; ``without_weights`` lists the sequences whose datum had no
    ``weights`` (0 here; ``check_dpo_pairs`` accepts them, batches refuse them); ``where`` says where each
    pair was read (``"line 3 of pairs.jsonl"``), for messages; ``source`` holds the datums they were read
    from. The pairs carry no mark of having been checked: whoever needs them checked checks them.
    """

    input_ids: np.ndarray
    target_tokens: np.ndarray
    weights: np.ndarray
    ref_logprobs: np.ndarray | None
    offsets: np.ndarray
    without_weights: tuple[int, ...] = ()
    where: tuple[str, ...] | None = None
    source: Sequence[Any] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> PackedTokens:
        """The token ids as ``PackedTokens`` (the same arrays, no copy), the form the reference scores."""
        return PackedTokens(self.input_ids, self.offsets)

    def label(self, index: int) -> str:
        """How messages name sequence ``index``: ``pair 3 (line 8 of pairs.jsonl): the rejected datum (index 7)``."""
        return datum_label(index, self.where[index // 2] if self.where else None)

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Sequence ``index``'s ``FIELDS`` as tensors (views of the flat arrays; ``check_batchable`` first)."""
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return {key: torch.from_numpy(getattr(self, key)[start:stop]) for key in FIELDS}

    def check_batchable(self) -> None:
        """A ``ValueError`` naming the first sequence a batch cannot hold: no ``weights``, or no ``ref_logprobs`` yet."""
        if self.without_weights:
            raise ValueError(f"{self.label(self.without_weights[0])} has no 'weights'")
        if self.ref_logprobs is None:
            raise ValueError(f"{self.label(0)} has no 'ref_logprobs' (attach them first, e.g. with "
                             "attach_reference_logprobs)")

    def scored(self, ref_logprobs: np.ndarray) -> PackedPairs:
        """These pairs with ``ref_logprobs``: every sequence's values back to back, one float32 value per token (the
        buffer kept as it is)."""
        return replace(self, ref_logprobs=ref_logprobs)

    def datums(self) -> list[Any]:
        """One datum per sequence, for the SDK boundary: the ``source`` datums (with ``ref_logprobs`` attached once
        scored: every field of theirs kept), else new ones (``model_input``, ``target_tokens`` and ``weights``,
        unless the sequence had none, as ``TensorData``); ``ref_logprobs`` are float32 views of the one buffer.

        Examples:
            >>> from loops_callbacks.data.dpo import check_dpo_pairs, dpo_pair_datums
            >>> pairs = check_dpo_pairs(dpo_pair_datums([1, 2, 3], [1, 4], 1))
            >>> chosen, rejected = replace(pairs, source=None).datums()
            >>> rejected.model_input.to_ints(), rejected.loss_fn_inputs["weights"].data
            ([1, 4], [1.0, 0.0])
        """
        bounds = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()))
        if self.source is not None:
            if self.ref_logprobs is None:
                return list(self.source)
            return [with_ref_logprobs(datum, index, reference_field(datum, self.ref_logprobs[start:stop]))
                    for index, (datum, (start, stop)) in enumerate(zip(self.source, bounds))]
        result = []
        for index, (start, stop) in enumerate(bounds):
            inputs: dict[str, Any] = {"target_tokens": TensorData(self.target_tokens[start:stop].tolist(), "int64")}
            if index not in self.without_weights:
                inputs["weights"] = TensorData(self.weights[start:stop].tolist(), "float32")
            if self.ref_logprobs is not None:
                inputs["ref_logprobs"] = self.ref_logprobs[start:stop]
            result.append(Datum(ModelInput.from_ints(self.input_ids[start:stop].tolist()), inputs))
        return result

    @classmethod
    def concatenate(cls, parts: Sequence[PackedPairs]) -> PackedPairs:
        """The parts' sequences one after the other, in one set of arrays (not yet scored, no source).

        Examples:
            >>> from loops_callbacks.data.dpo import check_dpo_pairs, dpo_pair_datums
            >>> one = check_dpo_pairs(dpo_pair_datums([1, 2], [1, 3], 1))
            >>> PackedPairs.concatenate([one, one]).offsets.tolist()
            [0, 2, 4, 6, 8]
        """
        firsts = np.cumsum([0] + [len(part) for part in parts])
        rows = {key: [getattr(part, key) for part in parts] for key in ("input_ids", "target_tokens", "weights")}
        lengths = [np.diff(part.offsets) for part in parts]
        where = None if any(part.where is None for part in parts) else sum((part.where for part in parts), ())
        without = tuple(int(first) + index for part, first in zip(parts, firsts) for index in part.without_weights)
        return cls._joined(rows, np.concatenate(lengths) if parts else np.zeros(0, np.int64), without, where)

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, np.ndarray]], without_weights: tuple[int, ...] = (),
                  where: tuple[str, ...] | None = None) -> PackedPairs:
        """Pairs of rows (``input_ids``, ``target_tokens``, ``weights`` each), joined once; no ``ref_logprobs``."""
        columns = {key: [row[key] for row in rows] for key in ("input_ids", "target_tokens", "weights")}
        lengths = np.fromiter((len(row["input_ids"]) for row in rows), dtype=np.int64, count=len(rows))
        return cls._joined(columns, lengths, without_weights, where)

    @classmethod
    def _joined(cls, columns: dict[str, list[np.ndarray]], lengths: np.ndarray, without_weights: tuple[int, ...],
                where: tuple[str, ...] | None) -> PackedPairs:
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arrays = {key: _joined(parts, key) for key, parts in columns.items()}
        return cls(**arrays, ref_logprobs=None, offsets=offsets, without_weights=without_weights, where=where)

    @classmethod
    def from_datums(cls, data: Sequence[Any]) -> PackedPairs:
        """Read each datum's ``model_input``, ``target_tokens`` (default: the next tokens, last 0), ``weights`` and
        ``ref_logprobs`` once, kept as ``source``; a field whose length is not the ``model_input``'s, or a
        ``ref_logprobs`` that some datums lack, is a ``ValueError`` naming the datum.

        Examples:
            >>> from loops_callbacks.data.dpo import dpo_pair_datums
            >>> PackedPairs.from_datums(dpo_pair_datums([1, 2], [1, 3], 1)).weights.tolist()
            [1.0, 0.0, 1.0, 0.0]
        """
        data = data if isinstance(data, (list, tuple)) else list(data)
        rows = [_read(datum, index) for index, datum in enumerate(data)]
        without = tuple(index for index, row in enumerate(rows) if row["weights"] is None)
        for index in without:
            rows[index]["weights"] = np.zeros(len(rows[index]["input_ids"]), np.float32)
        pairs = replace(cls.from_rows(rows, without), source=data)
        scored = [row["ref_logprobs"] is not None for row in rows]
        if not any(scored):
            return pairs
        if not all(scored):
            raise ValueError(f"{datum_label(scored.index(False))} has no 'ref_logprobs' (attach them first, e.g. "
                             "with attach_reference_logprobs)")
        return pairs.scored(_joined([row["ref_logprobs"] for row in rows], "ref_logprobs"))


def _read(datum: Any, index: int) -> dict[str, Any]:
    """Datum ``index``'s ``FIELDS`` as 1-D arrays (``None`` for ``weights`` / ``ref_logprobs`` when absent)."""
    label = datum_label(index)
    model_input = datum_model_input(datum)
    if model_input is None:
        raise ValueError(f"{label} has no model_input ({type(datum).__name__})")
    try:
        input_ids = np.asarray(model_input_tokens(model_input), dtype=np.int64)
        inputs = datum_loss_fn_inputs(datum, index=index)
    except TypeError as error:
        raise TypeError(f"{label}: {error}") from None
    row: dict[str, Any] = {"input_ids": input_ids, "target_tokens": np.append(input_ids[1:], 0)[: len(input_ids)]}
    for key in ("target_tokens", "weights", "ref_logprobs"):
        if key not in inputs:
            row.setdefault(key, None)
            continue
        value = inputs[key]
        if not (isinstance(value, np.ndarray) and value.ndim == 1):  # a 1-D numpy field is read as it is
            value = field_to_tensor(value, where=f"{label}, key {key!r}").detach().cpu().numpy().reshape(-1)
        if len(value) != len(input_ids):
            raise ValueError(f"{label}: {key!r} has {len(value)} values for a model_input of {len(input_ids)} tokens")
        row[key] = value.astype(FIELDS[key], copy=False)
    return row


def _joined(parts: list[np.ndarray], key: str) -> np.ndarray:
    """The parts back to back: a view of the buffer they already lie back to back in, else a copy."""
    dtype = FIELDS[key]
    if not parts:
        return np.zeros(0, dtype)
    first = parts[0]
    if first.base is not None and all(p.dtype == dtype and p.flags.c_contiguous and p.base is first.base
                                      for p in parts):
        address = first.__array_interface__["data"][0]
        for part in parts:
            if part.__array_interface__["data"][0] != address:
                break
            address += part.nbytes
        else:  # one buffer (its owner kept alive by the view): no copy
            total = sum(len(part) for part in parts)
            return np.lib.stride_tricks.as_strided(first, shape=(total,), strides=(first.itemsize,),
                                                   writeable=first.flags.writeable)
    return np.concatenate(parts).astype(dtype, copy=False)
