"""Token ids of the worst-divergent rows: the predicted token and the ids around it.

Only the few rows of the table are looked up, never the whole batch:

* ``PaddedTokens`` gathers from ``[B, T]`` ``input_ids`` / ``target_tokens`` on their device
  (no host synchronization);
* ``DatumTokens`` reads the chosen datums' ``model_input`` and ``target_tokens`` on the host.

For position k of a datum the token (the table's ``token`` column) is ``target_tokens[k]``, else
``model_input[k + 1]``, else ``NO_TOKEN`` (shown as ``<end>``). The context is ``model_input``
alone, as in the Loops SDK: the ``CONTEXT_BEFORE`` ids before index k + 1, then ``after``, which
starts with the id *at* k + 1 (the one shown between ``»«``; ``NO_TOKEN`` past the datum's end,
shown as ``»<end>«``) and goes on with the ``CONTEXT_AFTER - 1`` ids after it. So the context shows
``model_input[k + 1]`` even where ``target_tokens[k]`` differs from it (shifted targets, the last
position).

Example:
    >>> import torch
    >>> lookup = PaddedTokens(input_ids=torch.tensor([[1, 2, 3, 4]]), target_tokens=torch.tensor([[7, 7, 7, 7]]))
    >>> token, before, after = lookup.lookup(torch.tensor([0, 0]), torch.tensor([1, 3]))
    >>> token.tolist(), before[:, -2:].tolist(), after[:, :2].tolist()
    ([7, 7], [[1, 2], [3, 4]], [[3, 4], [-1, -1]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from loops_callbacks.fields import datum_loss_fn_inputs, datum_model_input, field_to_tensor, model_input_tokens

__all__ = [
    "NO_TOKEN",
    "CONTEXT_BEFORE",
    "CONTEXT_AFTER",
    "TokenLookup",
    "PaddedTokens",
    "DatumTokens",
]

NO_TOKEN = -1
CONTEXT_BEFORE = 40
"""Width of a look-up's ``before``: the Loops SDK's context of up to 40 ``model_input`` ids before
index k + 1, ``NO_TOKEN``-padded on the left."""
CONTEXT_AFTER = 1 + 20
"""Width of a look-up's ``after``: the id at k + 1 (the context's centre), then the SDK's up to 20
ids after it."""


class TokenLookup(Protocol):
    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``token [r]``, ``before [r, CONTEXT_BEFORE]``, ``after [r, CONTEXT_AFTER]`` (the centre first).

        All int64, ``NO_TOKEN`` where absent.
        """
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
            before = none[:, None].expand(-1, CONTEXT_BEFORE)
            after = none[:, None].expand(-1, CONTEXT_AFTER)
        else:
            before_offsets = torch.arange(-CONTEXT_BEFORE, 0, device=centre.device)
            after_offsets = torch.arange(0, CONTEXT_AFTER, device=centre.device)
            before = _take(self.input_ids, datum[:, None], centre[:, None] + before_offsets)
            after = _take(self.input_ids, datum[:, None], centre[:, None] + after_offsets)
        token = after[:, 0] if self.target_tokens is None else _take(self.target_tokens, datum, position)
        return token, before, after


class DatumTokens:
    """Look-ups in Loops / Tinker datums (``model_input`` and optional ``target_tokens``)."""

    def __init__(self, data: Sequence[Any]) -> None:
        self.data = data

    def lookup(self, datum: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        windows = torch.full((datum.shape[0], CONTEXT_BEFORE + CONTEXT_AFTER), NO_TOKEN, dtype=torch.int64)
        token = torch.full((datum.shape[0],), NO_TOKEN, dtype=torch.int64)
        for row, (i, k) in enumerate(zip(datum.tolist(), position.tolist())):  # one per table row
            model_input = datum_model_input(self.data[i])
            ids = model_input_tokens(model_input) if model_input is not None else []
            start = max(0, k + 1 - CONTEXT_BEFORE)
            window = ids[start : k + 1 + CONTEXT_AFTER]
            offset = CONTEXT_BEFORE - (k + 1 - start)
            windows[row, offset : offset + len(window)] = torch.tensor(window, dtype=torch.int64)
            target = datum_loss_fn_inputs(self.data[i], index=i).get("target_tokens")
            if target is not None:
                token[row] = int(field_to_tensor(target, where=f"datum {i}, key 'target_tokens'")[k])
            else:
                token[row] = windows[row, CONTEXT_BEFORE]
        windows, token = windows.to(datum.device), token.to(datum.device)
        return token, windows[:, :CONTEXT_BEFORE], windows[:, CONTEXT_BEFORE:]


def _take(tokens: torch.Tensor, row: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    inside = (column >= 0) & (column < tokens.shape[1])
    values = tokens[row, column.clamp(0, max(tokens.shape[1] - 1, 0))] if tokens.shape[1] else torch.zeros_like(column)
    return torch.where(inside, values.to(torch.int64), torch.full_like(column, NO_TOKEN))
