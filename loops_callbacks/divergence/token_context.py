"""Token ids of the worst-divergent rows: the predicted token and the ids around it.

Only the few rows of the table are looked up, never the whole batch:

* ``PaddedTokens`` gathers from ``[B, T]`` ``input_ids`` / ``target_tokens`` on their device
  (no host synchronization);
* ``DatumTokens`` reads the chosen datums' ``model_input`` and ``target_tokens`` on the host.

For position k of a datum the token is ``target_tokens[k]``, else ``model_input[k + 1]``, else
``NO_TOKEN`` (shown as ``<end>``); the context is ``model_input`` around index k + 1.

Example:
    >>> import torch
    >>> lookup = PaddedTokens(input_ids=torch.tensor([[1, 2, 3, 4]]), target_tokens=None)
    >>> token, before, after = lookup.lookup(torch.tensor([0]), torch.tensor([1]))
    >>> token.tolist(), before[0, -2:].tolist(), after[0, :2].tolist()
    ([3], [1, 2], [4, -1])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, field_to_tensor, model_input_tokens

__all__ = ["NO_TOKEN", "CONTEXT_BEFORE", "CONTEXT_AFTER", "TokenLookup", "PaddedTokens", "DatumTokens"]

NO_TOKEN = -1
CONTEXT_BEFORE = 40
CONTEXT_AFTER = 20


class TokenLookup(Protocol):
    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``token [k]``, ``before [k, 40]``, ``after [k, 20]`` int64, ``NO_TOKEN`` where absent."""
        ...


class PaddedTokens:
    """Look-ups in right-padded ``[B, T]`` token tensors (either may be ``None``)."""

    def __init__(self, input_ids: torch.Tensor | None, target_tokens: torch.Tensor | None) -> None:
        self.input_ids = input_ids
        self.target_tokens = target_tokens

    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        centre = position + 1
        if self.input_ids is None:
            none = torch.full_like(position, NO_TOKEN)
            token = none
            before = none[:, None].expand(-1, CONTEXT_BEFORE)
            after = none[:, None].expand(-1, CONTEXT_AFTER)
        else:
            token = _take(self.input_ids, datum, centre)
            before_offsets = torch.arange(-CONTEXT_BEFORE, 0, device=centre.device)
            after_offsets = torch.arange(1, CONTEXT_AFTER + 1, device=centre.device)
            before = _take(self.input_ids, datum[:, None], centre[:, None] + before_offsets)
            after = _take(self.input_ids, datum[:, None], centre[:, None] + after_offsets)
        if self.target_tokens is not None:
            token = _take(self.target_tokens, datum, position)
        return token, before, after


class DatumTokens:
    """Look-ups in Loops / Tinker datums (``model_input`` and optional ``target_tokens``)."""

    def __init__(self, data: Sequence[Any]) -> None:
        self.data = data

    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = CONTEXT_BEFORE + 1 + CONTEXT_AFTER
        rows = torch.full((datum.shape[0], width), NO_TOKEN, dtype=torch.int64)
        for row, (i, k) in enumerate(zip(datum.tolist(), position.tolist())):  # one per table row
            model_input = datum_model_input(self.data[i])
            ids = model_input_tokens(model_input) if model_input is not None else []
            start = max(0, k + 1 - CONTEXT_BEFORE)
            window = ids[start : k + 2 + CONTEXT_AFTER]
            offset = CONTEXT_BEFORE - (k + 1 - start)
            rows[row, offset : offset + len(window)] = torch.tensor(window, dtype=torch.int64)
            target = datum_loss_fn_inputs(self.data[i], index=i).get("target_tokens")
            if target is not None:
                rows[row, CONTEXT_BEFORE] = int(field_to_tensor(target, where=f"datum {i}, key 'target_tokens'")[k])
        rows = rows.to(datum.device)
        return rows[:, CONTEXT_BEFORE], rows[:, :CONTEXT_BEFORE], rows[:, CONTEXT_BEFORE + 1 :]


def _take(tokens: torch.Tensor, row: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    inside = (column >= 0) & (column < tokens.shape[1])
    values = tokens[row, column.clamp(0, max(tokens.shape[1] - 1, 0))] if tokens.shape[1] else torch.zeros_like(column)
    return torch.where(inside, values.to(torch.int64), torch.full_like(column, NO_TOKEN))
