"""DPO pairs in the Loops convention: building them, checking them, batching them.

A DPO data set is interleaved pairs: chosen at even indices, rejected at odd (pair p is sequences
2p and 2p + 1). Each sequence follows the Loops DPO convention:

- ``model_input`` is the FULL sequence (prompt + response);
- every per-position field has ``model_input``'s length, and position k belongs to the token
  predicted at k: ``target_tokens[k] = tokens[k + 1]`` (the last position predicts nothing:
  target 0, weight 0);
- ``weights[k] = 1.0`` when token k + 1 is a response token (``k + 1 >= prompt_length``), else 0.

Batches (``collate_dpo_pairs``) never split a pair; they are a dict of ``[2P, T]`` tensors, rows
interleaved (row 2i chosen, 2i + 1 rejected) and right-padded: ``input_ids`` (long, 0 on
padding), ``target_tokens`` (long, 0), ``weights`` (float, 0), ``ref_logprobs`` (float, 0) and
``attention_mask`` (bool, True on real tokens).

Examples:
    >>> chosen, rejected = dpo_pair_datums([1, 5, 6, 2], [1, 5, 7], prompt_length=2)
    >>> chosen.loss_fn_inputs["target_tokens"].data, chosen.loss_fn_inputs["weights"].data
    ([5, 6, 2, 0], [0.0, 1.0, 1.0, 0.0])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from loops_callbacks.conventions import tinker_convention_message
from loops_callbacks.data.sources import pair_label
from loops_callbacks.data.packed_pairs import FIELDS, PackedPairs
from loops_callbacks.reference.packing import OutOfVocabularyError
from loops_callbacks.types import Datum
from loops_callbacks.validation import check, check_int

__all__ = ["DPOPairDataset", "OutOfVocabularyError", "check_dpo_pairs", "collate_dpo_pairs", "dpo_pair_datums",
           "pair_rows"]


def dpo_pair_datums(chosen: Sequence[int], rejected: Sequence[int], prompt_length: int | None = None, *,
                    chosen_weights: Sequence[float] | None = None,
                    rejected_weights: Sequence[float] | None = None) -> tuple[Datum, Datum]:
    """The (chosen, rejected) datums of one preference pair, in the Loops DPO convention.

    ``chosen`` and ``rejected`` are full token sequences (prompt + response). Give either
    ``prompt_length`` (both sequences start with the same ``prompt_length`` tokens, and each has
    at least one response token after them), or per-token ``chosen_weights`` / ``rejected_weights``
    (one weight per token of the sequence, the weight of predicting that token; token 0 is never
    predicted, so its weight must be 0).

    Raises:
        TypeError / ValueError: token ids that are not ints in [0, 2**63), empty sequences, a bad or
            missing ``prompt_length``, prompts that differ, weights of the wrong length, negative or
            non-finite, or all zero.

    Examples:
        >>> chosen, rejected = dpo_pair_datums([1, 2, 3], [1, 4], chosen_weights=[0, 0, 1], rejected_weights=[0, 1])
        >>> chosen.loss_fn_inputs["weights"].data, rejected.loss_fn_inputs["weights"].data
        ([0.0, 1.0, 0.0], [1.0, 0.0])
    """
    rows = pair_rows(chosen, rejected, prompt_length, chosen_weights=chosen_weights, rejected_weights=rejected_weights)
    return tuple(PackedPairs.from_rows(rows).datums())  # type: ignore[return-value]


def pair_rows(chosen: Any, rejected: Any, prompt_length: Any = None, *, chosen_weights: Any = None,
              rejected_weights: Any = None) -> list[dict[str, np.ndarray]]:
    """``dpo_pair_datums``'s two sequences, checked, as ``PackedPairs`` rows (``input_ids``, ``target_tokens``,
    ``weights``): no datum.

    Examples:
        >>> [row["weights"].tolist() for row in pair_rows([1, 2, 3], [1, 4], 1)]
        [[1.0, 1.0, 0.0], [1.0, 0.0]]
    """
    chosen, rejected = _token_ids(chosen, "chosen"), _token_ids(rejected, "rejected")
    by_weights = chosen_weights is not None and rejected_weights is not None
    if by_weights == (prompt_length is not None) or (chosen_weights is None) != (rejected_weights is None):
        raise ValueError("give either prompt_length or both chosen_weights and rejected_weights (got prompt_length="
                         f"{prompt_length!r}, chosen_weights {'set' if chosen_weights is not None else 'None'}, "
                         f"rejected_weights {'set' if rejected_weights is not None else 'None'})")
    if by_weights:
        return [_row(chosen, _token_weights(chosen_weights, len(chosen), "chosen")),
                _row(rejected, _token_weights(rejected_weights, len(rejected), "rejected"))]
    check_int("prompt_length", prompt_length, least=1, what=" (token 0 is never predicted)")
    for name, tokens in (("chosen", chosen), ("rejected", rejected)):
        if prompt_length >= len(tokens):
            raise ValueError(f"prompt_length={prompt_length} leaves no response tokens in the {name} sequence "
                             f"({len(tokens)} tokens)")
    differ = np.flatnonzero(chosen[:prompt_length] != rejected[:prompt_length])
    if differ.size:
        position = int(differ[0])
        raise ValueError(f"the chosen and rejected prompts (first prompt_length={prompt_length} tokens) differ at "
                         f"token {position}: {chosen[position]} vs {rejected[position]}")
    return prompt_rows(chosen, rejected, prompt_length)


def prompt_rows(chosen: Sequence[int], rejected: Sequence[int], prompt_length: int) -> list[dict[str, np.ndarray]]:
    """The rows of a pair whose tokens after the first ``prompt_length`` are the response (weight 1), unchecked."""
    return [_row(np.asarray(ids, dtype=np.int64), (np.arange(len(ids)) >= prompt_length).astype(np.float32))
            for ids in (chosen, rejected)]


def _row(ids: np.ndarray, token_weights: np.ndarray) -> dict[str, np.ndarray]:
    """Position k predicts token k + 1 and carries that token's weight; the last position predicts nothing."""
    return {"input_ids": ids, "target_tokens": np.append(ids[1:], 0), "weights": np.append(token_weights[1:], np.float32(0))}


def _listed(values: Any, what: str) -> Sequence[Any]:
    """``values`` as a list (a tensor or an array converted), else a ``TypeError``: ``what`` must be a list of ..."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{what}, got {type(values).__name__}")
    return values


def _token_ids(tokens: Any, name: str) -> np.ndarray:
    tokens = _listed(tokens, f"the {name} sequence must be a list of token ids")
    for position, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"the {name} sequence has {token!r} at position {position}; token ids must be ints")
        if not 0 <= token < 2**63:  # what an int64 array holds (a JSON file may hold any int)
            raise ValueError(f"the {name} sequence has token id {token} at position {position}; token ids are ints "
                             "in [0, 2**63)")
    if not tokens:
        raise ValueError(f"the {name} sequence is empty")
    return np.asarray(tokens, dtype=np.int64)


def _token_weights(weights: Any, length: int, name: str) -> np.ndarray:
    weights = _listed(weights, f"{name}_weights must be a list of numbers")
    if len(weights) != length:
        raise ValueError(f"{name}_weights has {len(weights)} values for a {name} sequence of {length} tokens")
    for position, value in enumerate(weights):
        check(f"{name}_weights[{position}]", value, numbers.Real, "a finite number >= 0", lambda v: 0 <= v < math.inf)
    if weights[0] != 0:
        raise ValueError(f"{name}_weights[0]={weights[0]!r} must be 0: nothing predicts token 0")
    if not any(value > 0 for value in weights):
        raise ValueError(f"{name}_weights are all 0: the {name} sequence has no tokens to train on")
    return np.asarray(weights, dtype=np.float32)


def check_dpo_pairs(data: Sequence[Any] | PackedPairs, *, check_prompts: bool = True) -> PackedPairs:
    """Interleaved DPO datums (or pairs already packed) checked, as one ``PackedPairs``; each error a ``ValueError``
    naming the pair and datum.

    Datums are read once (``PackedPairs.from_datums``: every field of the ``model_input``'s length,
    a missing ``target_tokens`` the next tokens, a datum without ``weights`` kept and listed in
    ``without_weights``; ``data`` is not modified). Then, in vectorized passes over the arrays: a
    non-zero, even number of sequences; none empty; no weight on a last position (it predicts
    nothing: a weight there means Tinker's convention, see ``loops_callbacks.conventions``); and,
    when ``check_prompts`` and both sequences of a pair have weights in the prompt/response shape
    (zeros, then only positive weights up to the last position), the same prompt (the tokens up to
    the first weighted prediction). Packed pairs are checked every time: they may have been
    replaced or edited since they were made.

    Examples:
        >>> pairs = check_dpo_pairs([*dpo_pair_datums([1, 2, 3], [1, 4], 1)])
        >>> pairs.input_ids.tolist(), pairs.offsets.tolist(), pairs.weights.tolist()
        ([1, 2, 3, 1, 4], [0, 3, 5], [1.0, 1.0, 0.0, 1.0, 0.0])
    """
    pairs = data if isinstance(data, PackedPairs) else PackedPairs.from_datums(data)
    count, total = len(pairs), int(pairs.offsets[-1])
    if not count:
        raise ValueError("DPO data hold no datums: give at least one (chosen, rejected) pair")
    if count % 2:
        raise ValueError(f"DPO data hold an odd number of datums ({count}): they interleave chosen (even index) and "
                         f"rejected (odd index), and pair {count // 2} (datum {count - 1}) has no rejected datum")
    for key in ("input_ids", "target_tokens", "weights"):
        if len(getattr(pairs, key)) != total:
            raise ValueError(f"the packed pairs' {key!r} hold {len(getattr(pairs, key))} values for {total} tokens")
    empty = np.flatnonzero(np.diff(pairs.offsets) <= 0)
    if len(empty):
        raise ValueError(f"{pairs.label(int(empty[0]))} has an empty model_input: there is nothing to score")
    weighted_last = pairs.weights[pairs.offsets[1:] - 1] > 0
    weighted_last[list(pairs.without_weights)] = False
    if weighted_last.any():
        raise ValueError(tinker_convention_message(f"{pairs.label(int(np.argmax(weighted_last)))} carries"))
    if check_prompts:
        _check_prompts(pairs)
    return pairs


def _check_prompts(pairs: PackedPairs) -> None:
    """A ``ValueError`` for the first pair whose two sequences both have a prompt by their weights and whose prompts
    differ (sequences without weights aside)."""
    starts, stops = pairs.offsets[:-1], pairs.offsets[1:]
    weighted = np.flatnonzero(pairs.weights > 0)
    if not len(weighted):
        return
    low, high = np.searchsorted(weighted, starts), np.searchsorted(weighted, stops)
    first = weighted[np.minimum(low, len(weighted) - 1)] - starts  # the first weighted position, where there is one
    weighted_last = pairs.weights[stops - 1] > 0
    # zeros, then weights on every position from the first weighted one up to the last
    shaped = (high > low) & (high - low - weighted_last == np.maximum(stops - starts - 1 - first, 0))
    prompt = np.where(shaped, first + 1, 0)
    prompt[list(pairs.without_weights)] = 0
    chosen, rejected = prompt[0::2], prompt[1::2]
    compared = (chosen > 0) & (rejected > 0)
    differ = compared & (chosen != rejected)
    same = np.flatnonzero(compared & (chosen == rejected))
    if len(same):  # the tokens of each such pair's two prompts, side by side
        length = chosen[same]
        begin = np.cumsum(length) - length
        within = np.arange(int(length.sum())) - np.repeat(begin, length)
        unequal = (pairs.input_ids[np.repeat(starts[2 * same], length) + within]
                   != pairs.input_ids[np.repeat(starts[2 * same + 1], length) + within])
        differ[same] = np.add.reduceat(unequal, begin) > 0
    if not differ.any():
        return
    pair = int(np.argmax(differ))
    lengths, where = (int(chosen[pair]), int(rejected[pair])), pairs.where[pair] if pairs.where else None
    message = f"{pair_label(pair, where)}: the chosen (datum {2 * pair}) and rejected (datum {2 * pair + 1}) prompts differ"
    if lengths[0] != lengths[1]:
        raise ValueError(f"{message}: by their weights the chosen prompt has {lengths[0]} tokens and the rejected "
                         f"{lengths[1]}; both must start with the same prompt")
    ids = [pairs.input_ids[starts[index] : starts[index] + lengths[0]] for index in (2 * pair, 2 * pair + 1)]
    position = int(np.argmax(ids[0] != ids[1]))
    raise ValueError(f"{message} at token {position}: {ids[0][position]} vs {ids[1][position]}")


class DPOPairDataset(Dataset):
    """Preference pairs of scored DPO sequences, one item per pair (so samplers never split a pair).

    It holds one ``PackedPairs``: given one, as it is; given scored datums, read once
    (``PackedPairs.from_datums``; ``weights`` and ``ref_logprobs`` are required; values attached by
    scoring stay the one buffer they are). Each item is ``(chosen, rejected)``, each a dict of 1-D
    tensors ``input_ids``, ``target_tokens``, ``weights`` and ``ref_logprobs``, views of those arrays.

    Examples:
        >>> from loops_callbacks.helpers.datum import attach_reference_logprobs
        >>> class Flat:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-1.0] * (prompt.length - 1)
        >>> dataset = DPOPairDataset(attach_reference_logprobs(dpo_pair_datums([1, 2, 3], [1, 4], 1), Flat()))
        >>> len(dataset), dataset[0][1]["ref_logprobs"].tolist()
        (1, [-1.0, 0.0])
    """

    def __init__(self, data: Sequence[Any] | PackedPairs) -> None:
        if len(data) % 2:
            raise ValueError(f"DPOPairDataset needs interleaved pairs; got an odd number of datums ({len(data)})")
        self.packed = data if isinstance(data, PackedPairs) else PackedPairs.from_datums(data)
        self.packed.check_batchable()

    def __len__(self) -> int:
        return len(self.packed) // 2

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} of {len(self)}")
        index %= len(self)
        return self.packed.row(2 * index), self.packed.row(2 * index + 1)


def collate_dpo_pairs(pairs: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]
                      ) -> dict[str, torch.Tensor]:
    """A batch of ``DPOPairDataset`` items: ``[2P, T]`` tensors ``FIELDS`` (0 on padding) and ``attention_mask``
    (bool, True on real tokens), rows interleaved, right-padded."""
    rows = [row for pair in pairs for row in pair]
    batch = {key: pad_sequence([row[key] for row in rows], batch_first=True) for key in FIELDS}
    real = [torch.ones(row["input_ids"].numel(), dtype=torch.bool) for row in rows]
    batch["attention_mask"] = pad_sequence(real, batch_first=True)
    return batch
