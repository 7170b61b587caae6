"""The worst-divergent-tokens table: host rows from ``ROW`` arrays, with a readable context.

As in the Loops SDK, the ``token`` column is the predicted token (``target_tokens[k]``) and the
``context`` column is ``model_input`` alone around index k + 1: at a datum's last position it shows
``»<end>«`` whatever the target, and with shifted targets it shows ``model_input[k + 1]``.

Example (the last position of a datum ``[7, 8]`` whose target there is 9):
    >>> import numpy as np
    >>> from loops_callbacks.divergence.statistics import ROW
    >>> row = np.full(ROW.WIDTH, -1.0)
    >>> row[:7] = [2.0, -2.0, -0.5, -2.5, 0, 1, 9]
    >>> row[ROW.BEFORE][-2:] = [7, 8]
    >>> worst_token_rows(row[None, :])
    [[1, 0, 2, '9', -0.5, -2.5, -2.0, 0.1353, '⟦7 8»<end>«⟧']]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from loops_callbacks.divergence.metrics import is_ratio
from loops_callbacks.divergence.statistics import ROW
from loops_callbacks.divergence.token_context import NO_TOKEN

__all__ = [
    "WORST_TOKEN_COLUMNS",
    "Tokenizer",
    "worst_token_rows",
    "token_text",
    "format_context",
    "worst_tokens_markdown",
]

WORST_TOKEN_COLUMNS = [
    "rank",
    "datum",
    "position",
    "token",
    "logp_sampler",
    "logp_trainer",
    "diff",
    "is_weight",
    "context",
]
END = "<end>"
NEAR = 3


class Tokenizer(Protocol):
    """Anything with ``decode(list[int]) -> str``, e.g. a Hugging Face tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...


def worst_token_rows(worst: np.ndarray, tokenizer: Tokenizer | None = None) -> list[list[Any]]:
    """Table rows, rank 1 first: each row's own diff and importance ratio, rounded to 4 places.

    ``position`` is k + 1 (the position in ``model_input`` of the token predicted at k). The
    token is ``target_tokens[k]``, else ``model_input[k + 1]``; the ``token`` column always holds
    text, as in the Loops SDK: ``tokenizer.decode([id])``, the id as a decimal string without a
    tokenizer (or when it cannot decode the id), ``"<end>"`` when there is no token. ``is_weight``
    is ``is_ratio(d)``, exp(min(d, 80)), as in the importance-ratio metrics. ``context``
    is ``format_context`` of the row's ``model_input`` ids (``ROW.AFTER`` starts with the centre).
    """
    rows = []
    for rank, row in enumerate(worst, start=1):
        diff = float(row[ROW.DIFF])
        token = int(row[ROW.TOKEN])
        centre_and_after = row[ROW.AFTER]
        rows.append(
            [
                rank,
                int(row[ROW.DATUM]),
                int(row[ROW.POSITION]) + 1,
                token_text(token, tokenizer),
                round(float(row[ROW.SAMPLER]), 4),
                round(float(row[ROW.TRAINER]), 4),
                round(diff, 4),
                round(is_ratio(diff), 4),
                format_context(_ids(row[ROW.BEFORE]), int(centre_and_after[0]), _ids(centre_and_after[1:]), tokenizer),
            ]
        )
    return rows


def format_context(before: Sequence[int], centre: int, after: Sequence[int], tokenizer: Tokenizer | None) -> str:
    """``before⟦near»centre«near⟧after``, "near" being the 3 tokens on each side; text escaped.

    ``centre`` is ``model_input[k + 1]``, ``NO_TOKEN`` past the datum's end (shown as ``<end>``).

    Example:
        >>> format_context([1, 2, 3, 4], 5, [6, 7, 8, 9], None), format_context([1, 2], NO_TOKEN, [], None)
        ('1⟦2 3 4»5«6 7 8⟧9', '⟦1 2»<end>«⟧')
    """
    near_before, far_before = list(before[-NEAR:]) if before else [], list(before[:-NEAR]) if before else []
    near_after, far_after = list(after[:NEAR]), list(after[NEAR:])
    shown = END if centre == NO_TOKEN else _text([centre], tokenizer)
    return (
        f"{_text(far_before, tokenizer)}⟦{_text(near_before, tokenizer)}»{shown}"
        f"«{_text(near_after, tokenizer)}⟧{_text(far_after, tokenizer)}"
    )


def token_text(token: int, tokenizer: Tokenizer | None) -> str:
    """The ``token`` column: ``tokenizer.decode([token])``, else ``str(token)``; ``"<end>"`` for no token.

    Example:
        >>> token_text(49947, None), token_text(-1, None)
        ('49947', '<end>')
    """
    if token == NO_TOKEN:
        return END
    if tokenizer is not None:
        try:
            return str(tokenizer.decode([token]))
        except Exception:  # a tokenizer that cannot decode this id: the id, as without one
            pass
    return str(token)


def _ids(values: np.ndarray) -> list[int]:
    return [int(v) for v in values if v != NO_TOKEN]


def _text(ids: list[int], tokenizer: Tokenizer | None) -> str:
    if not ids:
        return ""
    text = None
    if tokenizer is not None:
        try:
            text = str(tokenizer.decode(ids))
        except Exception:  # a tokenizer that cannot decode these ids: fall back to the ids
            text = None
    if text is None:
        text = " ".join(str(i) for i in ids)
    return _escape(text)


def worst_tokens_markdown(rows: list[list[Any]]) -> str:
    """The table as Markdown (TensorBoard's text panel renders it); token and context as code.

    Example:
        >>> print(worst_tokens_markdown([[1, 0, 2, "9", -0.5, -2.5, -2.0, 0.1353, "a|b"]]))
        | rank | datum | position | token | logp_sampler | logp_trainer | diff | is_weight | context |
        |---|---|---|---|---|---|---|---|---|
        | 1 | 0 | 2 | `9` | -0.5 | -2.5 | -2.0 | 0.1353 | `a\\|b` |
    """
    token_column = WORST_TOKEN_COLUMNS.index("token")
    lines = ["| " + " | ".join(WORST_TOKEN_COLUMNS) + " |", "|" + "---|" * len(WORST_TOKEN_COLUMNS)]
    for row in rows:
        *numbers, context = row
        cells = [_code(_escape(str(value))) if i == token_column else str(value) for i, value in enumerate(numbers)]
        cells.append(_code(str(context)))  # already escaped by format_context
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _code(text: str) -> str:
    """A Markdown code span that survives a table cell: ``|`` escaped, a longer fence around backticks."""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"
