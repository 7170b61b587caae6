"""``PackedPairs``: interleaved DPO sequences back to back in flat arrays, the form batches are cut from.

Sequence i (pair i // 2; chosen at even i, rejected at odd) is ``[offsets[i], offsets[i + 1])`` of
``input_ids`` and ``target_tokens`` (int64), ``weights`` and ``ref_logprobs`` (float32). A list of
datums is read once (``from_datums``: each field checked, with the datum named); reference values
that are views of one buffer (as ``attach_reference_values`` makes them) are kept as that buffer,
not copied. ``row(i)`` gives sequence i's tensors as views. DPO pairs checked before scoring
(``check_dpo_pairs``) are a ``PackedPairs`` without ``ref_logprobs`` until ``scored(values)`` adds them;
``datums()`` makes datums of it for the SDK boundary.

Example:
    >>> from loops_callbacks.data.dpo import dpo_pair_datums
    >>> chosen, rejected = dpo_pair_datums([1, 2, 3], [1, 4], prompt_length=1)
    >>> for datum in (chosen, rejected):
    ...     datum.loss_fn_inputs["ref_logprobs"] = [-0.5] * (datum.model_input.length - 1) + [0.0]
    >>> packed = PackedPairs.from_datums([chosen, rejected])
    >>> packed.offsets.tolist(), packed.row(1)["target_tokens"].tolist(), packed.row(0)["ref_logprobs"].tolist()
    ([0, 3, 5], [4, 0], [-0.5, -0.5, 0.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from loops_callbacks.data.labels import datum_label
from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, field_to_tensor, model_input_tokens
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.types import Datum, ModelInput, TensorData

__all__ = ["BATCH_KEYS", "PackedPairs"]

BATCH_KEYS = ("input_ids", "target_tokens", "weights", "ref_logprobs")


@dataclass(frozen=True)
class PackedPairs:
    """Interleaved DPO sequences back to back (see the module docstring).

    ``ref_logprobs`` is ``None`` until scored; ``without_weights`` lists the sequences whose datum
    had no ``weights`` (their ``weights`` are 0 here; ``check_dpo_pairs`` accepts them, batches refuse them).
    The pairs carry no mark of having been checked: they can be replaced or edited, so whoever needs them
    checked checks them (``check_packed_pairs``).
    """

    input_ids: np.ndarray
    target_tokens: np.ndarray
    weights: np.ndarray
    ref_logprobs: np.ndarray | None
    offsets: np.ndarray
    without_weights: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> PackedTokens:
        """The token ids as ``PackedTokens`` (the same arrays, no copy), the form the reference scores."""
        return PackedTokens(self.input_ids, self.offsets)

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Sequence ``index``'s ``BATCH_KEYS`` tensors (views of the flat arrays)."""
        self.check_batchable()
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return {key: torch.from_numpy(getattr(self, key)[start:stop]) for key in BATCH_KEYS}

    def check_batchable(self) -> None:
        """A ``ValueError`` naming the first sequence a batch cannot hold: no ``weights``, or no ``ref_logprobs`` yet."""
        if self.without_weights:
            raise ValueError(f"{datum_label(self.without_weights[0])} has no 'weights'")
        if self.ref_logprobs is None:
            raise ValueError(
                f"{datum_label(0)} has no 'ref_logprobs' (attach them first, e.g. with attach_reference_logprobs)"
            )

    def scored(self, ref_logprobs: np.ndarray) -> PackedPairs:
        """These pairs with ``ref_logprobs``: every sequence's values back to back (one float32 buffer, kept as it is).

        Example:
            >>> from loops_callbacks.data.dpo import check_dpo_pairs, dpo_pair_datums
            >>> values = np.array([-1.0, 0.0, -2.0, 0.0], dtype=np.float32)
            >>> pairs = check_dpo_pairs(dpo_pair_datums([1, 2], [1, 3], 1)).scored(values)
            >>> pairs.ref_logprobs is values, pairs.row(1)["ref_logprobs"].tolist()
            (True, [-2.0, 0.0])
        """
        total = int(self.offsets[-1])
        if ref_logprobs.dtype != np.float32 or ref_logprobs.shape != (total,):
            raise ValueError(
                f"ref_logprobs must be {total} float32 values (one per token of the {len(self)} "
                f"datums), got {ref_logprobs.dtype} of shape {ref_logprobs.shape}"
            )
        return replace(self, ref_logprobs=ref_logprobs)

    def datums(self) -> list[Datum]:
        """One ``Datum`` per sequence, for the SDK boundary: ``model_input``, ``target_tokens`` and ``weights``
        (unless the sequence had none) as ``TensorData``, and ``ref_logprobs`` (once scored) as a float32
        view of the one buffer.

        Example:
            >>> from loops_callbacks.data.dpo import check_dpo_pairs, dpo_pair_datums
            >>> chosen, rejected = check_dpo_pairs(dpo_pair_datums([1, 2, 3], [1, 4], 1)).datums()
            >>> rejected.model_input.to_ints(), rejected.loss_fn_inputs["weights"].data
            ([1, 4], [1.0, 0.0])
        """
        result = []
        without = set(self.without_weights)
        for index in range(len(self)):
            start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
            length = stop - start
            inputs: dict[str, Any] = {
                "target_tokens": TensorData(self.target_tokens[start:stop].tolist(), "int64", [length])
            }
            if index not in without:
                inputs["weights"] = TensorData(self.weights[start:stop].tolist(), "float32", [length])
            if self.ref_logprobs is not None:
                inputs["ref_logprobs"] = self.ref_logprobs[start:stop]
            result.append(Datum(ModelInput.from_ints(self.input_ids[start:stop].tolist()), inputs))
        return result

    def head(self, count: int) -> PackedPairs:
        """The first ``count`` sequences (views of the arrays, no copy).

        Example:
            >>> from loops_callbacks.data.dpo import check_dpo_pairs, dpo_pair_datums
            >>> check_dpo_pairs([*dpo_pair_datums([1, 2], [1, 3], 1), *dpo_pair_datums([4, 5], [4, 6], 1)]).head(2).offsets.tolist()
            [0, 2, 4]
        """
        stop = int(self.offsets[count])
        return replace(
            self,
            **{key: getattr(self, key)[:stop] for key in BATCH_KEYS if getattr(self, key) is not None},
            offsets=self.offsets[: count + 1],
            without_weights=tuple(index for index in self.without_weights if index < count),
        )

    @classmethod
    def concatenate(cls, parts: Sequence[PackedPairs]) -> PackedPairs:
        """The parts' sequences one after the other, in one set of arrays (not yet scored).

        Example:
            >>> from loops_callbacks.data.dpo import check_dpo_pairs, dpo_pair_datums
            >>> one = check_dpo_pairs(dpo_pair_datums([1, 2], [1, 3], 1))
            >>> PackedPairs.concatenate([one, one]).offsets.tolist()
            [0, 2, 4, 6, 8]
        """
        if any(part.ref_logprobs is not None for part in parts):
            raise ValueError("PackedPairs.concatenate joins pairs before they are scored (no ref_logprobs)")
        lengths = np.concatenate([np.diff(part.offsets) for part in parts]) if parts else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        starts = np.cumsum([0] + [len(part) for part in parts])
        columns = {
            key: np.concatenate([getattr(part, key) for part in parts]) if parts else np.zeros(0, _DTYPES[key])
            for key in ("input_ids", "target_tokens", "weights")
        }
        without = tuple(int(start) + index for part, start in zip(parts, starts) for index in part.without_weights)
        return cls(offsets=offsets, ref_logprobs=None, without_weights=without, **columns)

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, np.ndarray]], without_weights: tuple[int, ...] = ()) -> PackedPairs:
        """Pairs of checked rows (``input_ids``, ``target_tokens``, ``weights`` each), joined once; no ``ref_logprobs``."""
        lengths = np.fromiter((len(row["input_ids"]) for row in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        columns = {key: _joined([row[key] for row in rows], key) for key in ("input_ids", "target_tokens", "weights")}
        return cls(offsets=offsets, ref_logprobs=None, without_weights=without_weights, **columns)

    @classmethod
    def from_datums(cls, data: Sequence[Any], ref_logprobs: np.ndarray | None = None) -> PackedPairs:
        """Read each datum's ``model_input``, ``target_tokens`` (default: the next tokens), ``weights``
        and ``ref_logprobs`` once; a missing or mis-sized field is a ``ValueError`` naming the datum.

        ``ref_logprobs``: every datum's values back to back (one float32 buffer, as
        ``score_packed_across_ranks`` returns them), kept as they are instead of the datums' own.

        Example:
            >>> from loops_callbacks.data.dpo import dpo_pair_datums
            >>> values = np.array([-1.0, 0.0, -2.0, 0.0], dtype=np.float32)
            >>> packed = PackedPairs.from_datums(dpo_pair_datums([1, 2], [1, 3], 1), ref_logprobs=values)
            >>> packed.ref_logprobs is values, packed.row(1)["ref_logprobs"].tolist()
            (True, [-2.0, 0.0])
        """
        given = ref_logprobs is not None
        rows = [_row_arrays(datum, index, with_ref_logprobs=not given) for index, datum in enumerate(data)]
        pairs = cls.from_rows(rows)
        if ref_logprobs is not None:
            return pairs.scored(ref_logprobs)
        return replace(pairs, ref_logprobs=_joined([row["ref_logprobs"] for row in rows], "ref_logprobs"))


_DTYPES = {"input_ids": np.int64, "target_tokens": np.int64, "weights": np.float32, "ref_logprobs": np.float32}


def _row_arrays(datum: Any, index: int, *, with_ref_logprobs: bool = True) -> dict[str, np.ndarray]:
    label = datum_label(index)
    model_input = datum_model_input(datum)
    if model_input is None:
        raise ValueError(f"{label} has no model_input")
    input_ids = np.asarray(model_input_tokens(model_input), dtype=np.int64)
    inputs = datum_loss_fn_inputs(datum, index=index)
    row = {"input_ids": input_ids}
    if "target_tokens" in inputs:
        row["target_tokens"] = _field(inputs["target_tokens"], f"{label}, key 'target_tokens'", np.int64)
    else:
        row["target_tokens"] = np.concatenate([input_ids[1:], np.zeros(1, np.int64)])
    for key in ("weights", "ref_logprobs") if with_ref_logprobs else ("weights",):
        if key not in inputs:
            hint = " (attach them first, e.g. with attach_reference_logprobs)" if key == "ref_logprobs" else ""
            raise ValueError(f"{label} has no {key!r}{hint}")
        row[key] = _field(inputs[key], f"{label}, key {key!r}", np.float32)
    for key, values in row.items():
        if len(values) != len(input_ids):
            raise ValueError(f"{label}: {key!r} has {len(values)} values for a model_input of {len(input_ids)} tokens")
    return row


def _field(field: Any, where: str, dtype: type) -> np.ndarray:
    """A field as a 1-D numpy array of ``dtype``: a float32 / int64 numpy field as it is (no copy)."""
    return field_values(field, where).astype(dtype, copy=False)


def field_values(field: Any, where: str) -> np.ndarray:
    """A per-position field as a 1-D numpy array in its own dtype (a 1-D numpy field as it is, no copy)."""
    if isinstance(field, np.ndarray) and field.ndim == 1:
        return field
    return field_to_tensor(field, where=where).detach().cpu().numpy().reshape(-1)


def _joined(parts: list[np.ndarray], key: str) -> np.ndarray:
    """The parts back to back: a view of the buffer they already lie back to back in, else a copy."""
    dtype = _DTYPES[key]
    if not parts:
        return np.zeros(0, dtype)
    first = parts[0]
    same_buffer = all(p.dtype == dtype and p.flags.c_contiguous and p.base is first.base for p in parts)
    if first.base is not None and same_buffer:
        address = first.__array_interface__["data"][0]
        for part in parts:
            if part.__array_interface__["data"][0] != address:
                break
            address += part.nbytes
        else:  # one buffer (its owner kept alive by the view): no copy
            total = sum(len(part) for part in parts)
            return np.lib.stride_tricks.as_strided(
                first, shape=(total,), strides=(first.itemsize,), writeable=first.flags.writeable
            )
    return np.concatenate(parts).astype(dtype, copy=False)
