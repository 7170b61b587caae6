"""Loops or Tinker datums: telling the two conventions apart, and converting Tinker's to Loops'.

- Loops (this package, ``dpo_pair_datums``): ``model_input`` is the full sequence of L tokens;
  position k predicts token k + 1, so the last position predicts nothing (target 0, weight 0)
  and ``attach_reference_logprobs`` sets its ``ref_logprobs`` to 0.0.
- Tinker (``tinker_cookbook``'s ``datum_from_model_input_weights``): ``model_input = tokens[:-1]``,
  ``target_tokens = tokens[1:]``, so the last position predicts the last token, with a weight.

A Tinker datum scored under the Loops rule loses the reference logprob of its last token
(``ref[L-1] = 0.0``; measured at -3.6 to -14.6 nats a sequence), and the DPO margins built on it
are off by that much. A weight > 0 on the last position gives it away: no Loops datum has one.

Examples:
    >>> from loops_callbacks.types import Datum, ModelInput, TensorData
    >>> tinker = Datum(ModelInput.from_ints([1, 5]), {"target_tokens": TensorData([5, 6], "int64", [2]),
    ...                                                "weights": TensorData([0.0, 1.0], "float32", [2])})
    >>> weighted_last_positions([tinker])
    [0]
    >>> [loops] = from_tinker_convention([tinker])
    >>> loops.model_input.to_ints(), loops.loss_fn_inputs["weights"].data, weighted_last_positions([loops])
    ([1, 5, 6], [0.0, 1.0, 0.0], [])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, field_to_tensor, model_input_tokens
from loops_callbacks.types import Datum, ModelInput, TensorData

__all__ = ["TinkerConventionWarning", "from_tinker_convention"]


class TinkerConventionWarning(UserWarning):
    """Datums in Tinker's convention were scored under the Loops rule, losing their last token's reference logprob."""


def weighted_last_positions(data: Sequence[Any]) -> list[int]:
    """Indices of the datums whose ``weights`` are > 0 on the last position (Tinker's convention).

    Reads one value per datum (no conversion of whole fields); datums without ``weights`` are not
    counted.
    """
    found = []
    for index, datum in enumerate(data):
        try:
            weights = datum_loss_fn_inputs(datum, index=index).get("weights")
        except TypeError:
            continue
        last = _last_value(weights)
        if last is not None and last > 0:
            found.append(index)
    return found


def _last_value(field: Any) -> float | None:
    if field is None:
        return None
    values = getattr(field, "data", field)  # TensorData (ours, Tinker's, Loops') keeps a flat list in .data
    if isinstance(values, (list, tuple)):
        return float(values[-1]) if values and values[-1] is not None else None
    if isinstance(values, (torch.Tensor, np.ndarray)):
        flat = values.reshape(-1)
        return float(flat[-1]) if flat.shape[0] else None
    return None


def tinker_convention_message(subject: str) -> str:
    """``subject`` ("3 of 8 datums (index 0, 2, 5) carry") + what it costs and the fix.

    Examples:
        >>> tinker_convention_message("datum 0 carries").split(",")[0]
        'datum 0 carries weight on the last position'
    """
    return (
        f"{subject} weight on the last position, as in Tinker's convention (model_input = tokens[:-1], "
        "target_tokens = tokens[1:]). In the Loops convention the last position predicts nothing and its "
        "ref_logprobs is 0.0, so the last token's reference logprob is lost (several nats a sequence) and the DPO "
        "margins are wrong: convert them with loops_callbacks.data.from_tinker_convention(data) (it appends the last "
        "target token to model_input and a 0 to target_tokens and weights), or build them with dpo_pair_datums"
    )


def describe_indices(indices: Sequence[int], total: int) -> str:
    """``"3 of 8 datums (index 0, 2, 5) carry"`` for ``tinker_convention_message``."""
    shown = ", ".join(str(i) for i in indices[:5]) + (", ..." if len(indices) > 5 else "")
    return f"{len(indices)} of {total} datums (index {shown}) carry"


def from_tinker_convention(data: Sequence[Any]) -> list[Datum]:
    """Datums in the Loops convention from datums in Tinker's (any ``ref_logprobs`` dropped: score them again).

    Each datum needs ``target_tokens`` with ``target_tokens[k] = model_input[k + 1]`` for every k
    but the last; the last target token is appended to ``model_input``, and ``target_tokens`` and
    ``weights`` get a trailing 0 (the new last position predicts nothing).

    Raises:
        ValueError: a datum without ``target_tokens``, whose targets are not its inputs shifted by
            one, or with a weight of 0 on its last position (a Loops datum).
    """
    converted = []
    for index, datum in enumerate(data):
        model_input = datum_model_input(datum)
        inputs = datum_loss_fn_inputs(datum, index=index)
        if model_input is None or "target_tokens" not in inputs:
            raise ValueError(f"datum {index}: a Tinker datum needs model_input and loss_fn_inputs['target_tokens']")
        tokens = model_input_tokens(model_input)
        targets = field_to_tensor(inputs["target_tokens"], where=f"datum {index}, key 'target_tokens'").long().tolist()
        if len(targets) != len(tokens) or targets[:-1] != tokens[1:]:
            raise ValueError(
                f"datum {index}: target_tokens are not model_input shifted by one ({len(targets)} targets for "
                f"{len(tokens)} inputs), so it is not in Tinker's convention"
            )
        last_weight = _last_value(inputs.get("weights"))
        if last_weight is not None and not last_weight > 0:
            raise ValueError(f"datum {index}: no weight on its last position, so it is in the Loops convention already "
                             "(converting it would append a token that is not there)")
        length = len(tokens) + 1
        fields = {"target_tokens": TensorData([*targets, 0], "int64", [length])}
        if "weights" in inputs:
            weights = field_to_tensor(inputs["weights"], where=f"datum {index}, key 'weights'").tolist()
            fields["weights"] = TensorData([*map(float, weights), 0.0], "float32", [length])
        converted.append(Datum(model_input=ModelInput.from_ints([*tokens, targets[-1]]), loss_fn_inputs=fields))
    return converted
