"""DPO pairs in the Loops convention: building them, reading them, checking them, batching them.

A DPO data set is a ``list[Datum]`` of interleaved pairs: chosen at even indices, rejected at odd
(pair p is datums 2p and 2p + 1). Each datum follows the Loops DPO convention:

- ``model_input`` is the FULL sequence (prompt + response);
- every per-position field has ``model_input``'s length, and position k belongs to the token
  predicted at k: ``target_tokens[k] = tokens[k + 1]`` (the last position predicts nothing:
  target 0, weight 0);
- ``weights[k] = 1.0`` when token k + 1 is a response token (``k + 1 >= prompt_length``), else 0.

Batches (``collate_dpo_pairs``) never split a pair; they are a dict of ``[2P, T]`` tensors, rows
interleaved (row 2i chosen, 2i + 1 rejected) and right-padded:
``input_ids`` (long, 0 on padding), ``target_tokens`` (long, 0), ``weights`` (float, 0),
``ref_logprobs`` (float, 0) and ``attention_mask`` (bool, True on real tokens).

Example:
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
from torch.utils.data import Dataset

from loops_callbacks.conventions import tinker_convention_message
from loops_callbacks.data.labels import datum_label
from loops_callbacks.data.packed_pairs import BATCH_KEYS, PackedPairs, field_values
from loops_callbacks.fields import (
    datum_loss_fn_inputs,
    datum_model_input,
    model_input_tokens,
)
from loops_callbacks.reference.packing import OutOfVocabularyError, PackedTokens, check_token_ids
from loops_callbacks.types import Datum, ModelInput, TensorData

__all__ = [
    "DPOPairDataset",
    "OutOfVocabularyError",
    "check_dpo_pairs",
    "check_packed_pairs",
    "check_vocabulary",
    "collate_dpo_pairs",
    "dpo_pair_datums",
    "dpo_records_to_datums",
    "validate_dpo_pairs",
]


def dpo_pair_datums(
    chosen: Sequence[int],
    rejected: Sequence[int],
    prompt_length: int | None = None,
    *,
    chosen_weights: Sequence[float] | None = None,
    rejected_weights: Sequence[float] | None = None,
) -> tuple[Datum, Datum]:
    """The (chosen, rejected) datums of one preference pair, in the Loops DPO convention.

    ``chosen`` and ``rejected`` are full token sequences (prompt + response). Give either
    ``prompt_length`` (both sequences start with the same ``prompt_length`` tokens, and each has
    at least one response token after them), or per-token ``chosen_weights`` / ``rejected_weights``
    (one weight per token of the sequence, the weight of predicting that token; token 0 is never
    predicted, so its weight must be 0).

    Raises:
        ValueError: empty sequences, token ids that are not ints in [0, 2**63), a bad or missing
            ``prompt_length``, prompts that differ, weights of the wrong length, negative or
            non-finite, or all zero.

    Example:
        >>> chosen, rejected = dpo_pair_datums([1, 2, 3], [1, 4], chosen_weights=[0, 0, 1], rejected_weights=[0, 1])
        >>> chosen.loss_fn_inputs["weights"].data, rejected.loss_fn_inputs["weights"].data
        ([0.0, 1.0, 0.0], [1.0, 0.0])
    """
    chosen_tokens = _token_list(chosen, "chosen")
    rejected_tokens = _token_list(rejected, "rejected")
    by_weights = chosen_weights is not None or rejected_weights is not None
    if by_weights == (prompt_length is not None):
        raise ValueError(
            "give either prompt_length or both chosen_weights and rejected_weights "
            f"(got prompt_length={prompt_length!r}, chosen_weights {'set' if chosen_weights is not None else 'None'}, "
            f"rejected_weights {'set' if rejected_weights is not None else 'None'})"
        )
    if not by_weights:
        _check_prompt_length(prompt_length, chosen_tokens, rejected_tokens)
        assert prompt_length is not None
        return _prompt_pair(chosen_tokens, rejected_tokens, prompt_length)
    if chosen_weights is None or rejected_weights is None:
        raise ValueError("give both chosen_weights and rejected_weights, or prompt_length")
    return (
        _datum(chosen_tokens, _token_weights(chosen_weights, len(chosen_tokens), "chosen")),
        _datum(rejected_tokens, _token_weights(rejected_weights, len(rejected_tokens), "rejected")),
    )


def _token_list(tokens: Any, name: str) -> list[int]:
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"the {name} sequence must be a list of token ids, got {type(tokens).__name__}")
    for position, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(f"the {name} sequence has {token!r} at position {position}; token ids must be ints")
        if not 0 <= token < 2**63:  # what an int64 array holds (a JSON file may hold any int)
            raise ValueError(
                f"the {name} sequence has token id {token} at position {position}; token ids are ints in [0, 2**63)"
            )
    if not tokens:
        raise ValueError(f"the {name} sequence is empty")
    return [int(token) for token in tokens]


def _check_prompt_length(prompt_length: Any, chosen: list[int], rejected: list[int]) -> None:
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int):
        raise ValueError(f"prompt_length must be an int, got {prompt_length!r}")
    if prompt_length < 1:
        raise ValueError(f"prompt_length={prompt_length} must be at least 1 (token 0 is never predicted)")
    for name, tokens in (("chosen", chosen), ("rejected", rejected)):
        if prompt_length >= len(tokens):
            raise ValueError(
                f"prompt_length={prompt_length} leaves no response tokens in the {name} sequence ({len(tokens)} tokens)"
            )
    if chosen[:prompt_length] != rejected[:prompt_length]:
        position = next(i for i in range(prompt_length) if chosen[i] != rejected[i])
        raise ValueError(
            f"the chosen and rejected prompts (first prompt_length={prompt_length} tokens) differ at "
            f"token {position}: {chosen[position]} vs {rejected[position]}"
        )


def _token_weights(weights: Any, length: int, name: str) -> list[float]:
    if isinstance(weights, (torch.Tensor, np.ndarray)):
        weights = weights.tolist()
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ValueError(f"{name}_weights must be a list of numbers, got {type(weights).__name__}")
    values = list(weights)
    if len(values) != length:
        raise ValueError(f"{name}_weights has {len(values)} values for a {name} sequence of {length} tokens")
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}_weights[{position}]={value!r} must be a finite number >= 0")
    if values[0] != 0:
        raise ValueError(f"{name}_weights[0]={values[0]!r} must be 0: nothing predicts token 0")
    if not any(value > 0 for value in values):
        raise ValueError(f"{name}_weights are all 0: the {name} sequence has no tokens to train on")
    return [float(value) for value in values]


def _datum(tokens: list[int], token_weights: list[float]) -> Datum:
    """Position k predicts token k + 1 and carries that token's weight; the last position predicts nothing."""
    length = len(tokens)
    return Datum(
        model_input=ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": TensorData([*tokens[1:], 0], "int64", [length]),
            "weights": TensorData([*token_weights[1:], 0.0], "float32", [length]),
        },
    )


def _prompt_pair(chosen: list[int], rejected: list[int], prompt_length: int) -> tuple[Datum, Datum]:
    """The pair's datums, weight 1 on every token after the first ``prompt_length`` (checked by the caller)."""
    return tuple(  # type: ignore[return-value]
        _datum(tokens, [0.0] * prompt_length + [1.0] * (len(tokens) - prompt_length)) for tokens in (chosen, rejected)
    )


def prompt_pair_rows(chosen: list[int], rejected: list[int], prompt_length: int) -> list[dict[str, np.ndarray]]:
    """``_prompt_pair``'s two sequences as ``PackedPairs`` rows (``input_ids``, ``target_tokens``, ``weights``), no datum.

    Example:
        >>> [row["weights"].tolist() for row in prompt_pair_rows([1, 2, 3], [1, 4], 1)]
        [[1.0, 1.0, 0.0], [1.0, 0.0]]
    """
    rows = []
    for tokens in (chosen, rejected):
        ids = np.asarray(tokens, dtype=np.int64)
        weights = np.zeros(len(ids), np.float32)
        weights[prompt_length - 1 : len(ids) - 1] = 1.0  # position k predicts token k + 1, a response token
        rows.append({"input_ids": ids, "target_tokens": np.append(ids[1:], 0), "weights": weights})
    return rows


def dpo_records_to_datums(records: Sequence[Mapping[str, Any]], *, where: str = "") -> list[Datum]:
    """Interleaved datums from records ``{"chosen", "rejected", "prompt_length"}`` (or the two weights).

    Record i becomes pair i (datums 2i and 2i + 1); other keys of a record are ignored. Errors name
    the pair, and ``where`` (e.g. a file name) when given.

    Example:
        >>> records = [{"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1}]
        >>> [d.model_input.to_ints() for d in dpo_records_to_datums(records)]
        [[1, 2], [1, 3]]
    """
    data: list[Datum] = []
    for index, record in enumerate(records):
        data.extend(_record_pair(record, f"pair {index}{where}"))
    return data


def _record_pair(record: Any, label: str) -> tuple[Datum, Datum]:
    if not isinstance(record, Mapping):
        raise ValueError(f"{label}: expected a record (a JSON object), got {type(record).__name__}")
    missing = [key for key in ("chosen", "rejected") if key not in record]
    if missing:
        raise ValueError(f"{label}: the record has no {' or '.join(repr(k) for k in missing)} (keys: {sorted(record)})")
    try:
        return dpo_pair_datums(
            record["chosen"],
            record["rejected"],
            record.get("prompt_length"),
            chosen_weights=record.get("chosen_weights"),
            rejected_weights=record.get("rejected_weights"),
        )
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from None


def check_dpo_pairs(data: Sequence[Any], *, check_prompts: bool = True) -> PackedPairs:
    """Check interleaved DPO datums and read them, in one pass, into one ``PackedPairs`` (no ``ref_logprobs`` yet).

    Checks, each a ``ValueError`` naming the pair (and datum) index: a non-zero, even number of datums; every
    datum has a non-empty ``model_input``; ``target_tokens`` / ``weights``, when present, have the
    ``model_input``'s length; no weight on the last position (it predicts nothing: a weight there
    means Tinker's convention, see ``loops_callbacks.conventions``); and, when ``check_prompts``
    and both datums of a pair carry ``weights``
    in the prompt/response shape (zeros, then only positive weights up to the last position),
    the two prompts (the tokens up to the first weighted prediction) are the same.

    A missing ``target_tokens`` is the next tokens (last 0); a datum without ``weights`` is kept,
    listed in ``without_weights`` (a batch refuses it, naming it). ``data`` is not modified.

    Example:
        >>> pairs = check_dpo_pairs([*dpo_pair_datums([1, 2, 3], [1, 4], 1)])
        >>> pairs.input_ids.tolist(), pairs.offsets.tolist(), pairs.weights.tolist()
        ([1, 2, 3, 1, 4], [0, 3, 5], [1.0, 1.0, 0.0, 1.0, 0.0])
    """
    _check_count(len(data))
    rows: list[dict[str, np.ndarray]] = []
    prompts: list[int | None] = []
    without_weights: list[int] = []
    for index, datum in enumerate(data):
        row, prompt_length = _checked_row(datum, index)
        if row["weights"] is None:
            without_weights.append(index)
            row["weights"] = np.zeros(len(row["input_ids"]), np.float32)
        rows.append(row)
        prompts.append(prompt_length)
        if check_prompts and index % 2 and prompts[index - 1] is not None and prompt_length is not None:
            chosen, rejected = rows[index - 1]["input_ids"], row["input_ids"]
            _check_same_prompt(index // 2, chosen, rejected, prompts[index - 1], prompt_length)
    return PackedPairs.from_rows(rows, without_weights=tuple(without_weights))


def check_packed_pairs(pairs: PackedPairs, *, check_prompts: bool = True) -> PackedPairs:
    """``check_dpo_pairs``'s checks on pairs given packed (e.g. by a ``dpo_pairs()`` hook); ``pairs`` itself when
    they pass, else the same ``ValueError`` naming the pair and datum.

    Every call checks, in vectorized passes over the arrays: pairs ``check_dpo_pairs`` made are checked again,
    since they may since have been replaced or edited in place.

    Example:
        >>> pairs = check_dpo_pairs(dpo_pair_datums([1, 2, 3], [1, 4], 1))
        >>> check_packed_pairs(pairs) is pairs
        True
    """
    _check_count(len(pairs))
    lengths = np.diff(pairs.offsets)
    total = int(pairs.offsets[-1])
    for key in ("input_ids", "target_tokens", "weights"):
        if len(getattr(pairs, key)) != total:
            raise ValueError(f"the packed pairs' {key!r} hold {len(getattr(pairs, key))} values for {total} tokens")
    empty = np.flatnonzero(lengths <= 0)
    if len(empty):
        raise ValueError(f"{datum_label(int(empty[0]))} has an empty model_input: there is nothing to score")
    weighted_last = pairs.weights[pairs.offsets[1:] - 1] > 0
    weighted_last[list(pairs.without_weights)] = False
    if weighted_last.any():
        raise ValueError(tinker_convention_message(f"{datum_label(int(np.argmax(weighted_last)))} carries"))
    if check_prompts:
        _check_packed_prompts(pairs)
    return pairs


def _check_packed_prompts(pairs: PackedPairs) -> None:
    """``_check_same_prompt``'s error for the first pair whose two sequences both have a prompt by their weights
    (``_prompt_length``, sequences without weights aside) and whose prompts differ; vectorized over the pairs."""
    starts, stops = pairs.offsets[:-1], pairs.offsets[1:]
    weighted = np.flatnonzero(pairs.weights > 0)
    if not len(weighted):
        return
    low, high = np.searchsorted(weighted, starts), np.searchsorted(weighted, stops)
    first = weighted[np.minimum(low, len(weighted) - 1)] - starts  # the first weighted position, where there is one
    weighted_last = pairs.weights[stops - 1] > 0
    # zeros, then weights on every position from the first weighted one up to the last (_prompt_length)
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
        unequal = (
            pairs.input_ids[np.repeat(starts[2 * same], length) + within]
            != pairs.input_ids[np.repeat(starts[2 * same + 1], length) + within]
        )
        differ[same] = np.add.reduceat(unequal, begin) > 0
    if differ.any():
        pair = int(np.argmax(differ))
        ids = [pairs.input_ids[starts[index] : stops[index]] for index in (2 * pair, 2 * pair + 1)]
        _check_same_prompt(pair, ids[0], ids[1], int(chosen[pair]), int(rejected[pair]))


def _check_count(count: int) -> None:
    """A ``ValueError`` unless ``count`` datums are a whole, non-zero number of (chosen, rejected) pairs."""
    if not count:
        raise ValueError("DPO data hold no datums: give at least one (chosen, rejected) pair")
    if count % 2:
        raise ValueError(
            f"DPO data hold an odd number of datums ({count}): they interleave chosen (even index) and "
            f"rejected (odd index), and pair {count // 2} (datum {count - 1}) has no rejected datum"
        )


def _checked_row(datum: Any, index: int) -> tuple[dict[str, Any], int | None]:
    """Datum ``index``'s ``input_ids``, ``target_tokens`` and ``weights`` (``None`` when absent), checked, and
    its prompt length by its weights (``None`` unless they are zeros then positive up to the last position)."""
    label = datum_label(index)
    model_input = datum_model_input(datum)
    if model_input is None:
        raise ValueError(f"{label} has no model_input ({type(datum).__name__})")
    try:
        ids = model_input_tokens(model_input)
        inputs = datum_loss_fn_inputs(datum, index=index)
    except TypeError as error:
        raise ValueError(f"{label}: {error}") from None
    if not ids:
        raise ValueError(f"{label} has an empty model_input: there is nothing to score")
    input_ids = np.asarray(ids, dtype=np.int64)
    row: dict[str, Any] = {"input_ids": input_ids, "weights": None}
    prompt_length = None
    for key in ("target_tokens", "weights"):
        if key not in inputs:
            continue
        values = field_values(inputs[key], f"{label}, key {key!r}")
        if len(values) != len(ids):
            raise ValueError(f"{label}: {key!r} has {len(values)} values for a model_input of {len(ids)} tokens")
        if key == "weights":
            if len(values) and values[-1] > 0:
                raise ValueError(tinker_convention_message(f"{label} carries"))
            prompt_length = _prompt_length(values)
        row[key] = values.astype(np.int64 if key == "target_tokens" else np.float32, copy=False)
    if "target_tokens" not in row:
        row["target_tokens"] = np.concatenate([input_ids[1:], np.zeros(1, np.int64)])
    return row, prompt_length


def validate_dpo_pairs(data: Sequence[Any], *, check_prompts: bool = True) -> list[list[int]]:
    """``check_dpo_pairs``'s checks, returning each datum's token ids as a list (``model_input`` of each datum).

    Example:
        >>> validate_dpo_pairs([*dpo_pair_datums([1, 2], [1, 3], 1)])
        [[1, 2], [1, 3]]
    """
    pairs = check_dpo_pairs(data, check_prompts=check_prompts)
    return [pairs.input_ids[start:stop].tolist() for start, stop in zip(pairs.offsets[:-1], pairs.offsets[1:])]


def _prompt_length(weights: np.ndarray) -> int | None:
    """1 + the first weighted position, when the weights are zeros then positive up to the last position."""
    positive = weights > 0
    if not positive.any():
        return None
    first = int(np.argmax(positive))
    if not positive[first:-1].all():
        return None
    return first + 1


def _check_same_prompt(
    pair: int, chosen: np.ndarray, rejected: np.ndarray, chosen_length: int, rejected_length: int
) -> None:
    if chosen_length == rejected_length and np.array_equal(chosen[:chosen_length], rejected[:rejected_length]):
        return
    where = f"pair {pair}: the chosen (datum {2 * pair}) and rejected (datum {2 * pair + 1}) prompts differ"
    if chosen_length != rejected_length:
        raise ValueError(
            f"{where}: by their weights the chosen prompt has {chosen_length} tokens and the rejected "
            f"{rejected_length}; both must start with the same prompt"
        )
    position = int(np.argmax(chosen[:chosen_length] != rejected[:chosen_length]))
    raise ValueError(f"{where} at token {position}: {chosen[position]} vs {rejected[position]}")


def check_vocabulary(tokens: Sequence[Sequence[int]] | PackedTokens, vocab_size: int | None) -> None:
    """``OutOfVocabularyError`` (a ``ValueError``) naming the pair, datum and position of the first
    token id outside ``[0, vocab_size)``; negative ids are always rejected, with ``vocab_size=None`` only they are.

    The check ``compute_reference_logprobs`` runs (once, inside ``score_across_ranks``), for data
    checked before a reference is at hand.

    Example:
        >>> try:
        ...     check_vocabulary([[1, 2], [1, 3], [1, 40], [1, 3]], 16)
        ... except OutOfVocabularyError as error:
        ...     print(error.pair, error.index, error.position, error.token)
        1 2 1 40
    """
    packed = tokens if isinstance(tokens, PackedTokens) else PackedTokens.from_sequences(tokens)
    check_token_ids(packed, vocab_size, datum_name=datum_label)


class DPOPairDataset(Dataset):
    """Preference pairs of scored DPO sequences, one item per pair (so samplers never split a pair).

    It holds one ``PackedPairs`` (flat arrays and offsets): given one, as it is; given scored
    datums, read once (``PackedPairs.from_datums``: missing ``target_tokens`` are taken from
    ``model_input``, ``tokens[k + 1]`` and last 0; ``weights`` and ``ref_logprobs`` are required;
    values attached by ``attach_reference_logprobs`` stay the one buffer they are). Each item is
    ``(chosen, rejected)``, each a dict of 1-D tensors ``input_ids``, ``target_tokens``,
    ``weights`` and ``ref_logprobs``, views of those arrays.

    Example:
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


def collate_dpo_pairs(
    pairs: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]],
) -> dict[str, torch.Tensor]:
    """A batch of ``DPOPairDataset`` items: ``[2P, T]`` tensors, rows interleaved, right-padded.

    Keys: ``input_ids`` and ``target_tokens`` (long, 0 on padding), ``weights`` and
    ``ref_logprobs`` (float32, 0 on padding), ``attention_mask`` (bool, True on real tokens).
    """
    rows = [row for pair in pairs for row in pair]
    width = max((row["input_ids"].numel() for row in rows), default=0)
    batch = {
        "input_ids": torch.zeros(len(rows), width, dtype=torch.long),
        "target_tokens": torch.zeros(len(rows), width, dtype=torch.long),
        "weights": torch.zeros(len(rows), width, dtype=torch.float32),
        "ref_logprobs": torch.zeros(len(rows), width, dtype=torch.float32),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.bool),
    }
    for index, row in enumerate(rows):
        length = row["input_ids"].numel()
        for key in BATCH_KEYS:
            batch[key][index, :length] = row[key]
        batch["attention_mask"][index, :length] = True
    return batch
