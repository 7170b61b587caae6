"""W&B media for the divergence metrics: the per-token-diff histogram and the worst-tokens table.

``wandb`` is imported only when one of them is built.

Example:
    >>> import numpy as np
    >>> from loops_callbacks.divergence.statistics import HostDivergence
    >>> host = HostDivergence(totals={"n_action_tokens": 0.0}, extrema={}, worst=np.zeros((0, 67)),
    ...                       diffs=np.zeros(0))
    >>> divergence_media(host, prefix="div/")
    {}
"""

from __future__ import annotations

from typing import Any

from loops_callbacks.divergence.metrics import histogram_values
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.divergence.worst_tokens import WORST_TOKEN_COLUMNS, Tokenizer, worst_token_rows

__all__ = ["HISTOGRAM_KEY", "TABLE_KEY", "divergence_media"]

HISTOGRAM_KEY = "per_token_diff_hist"
TABLE_KEY = "worst_tokens"


def divergence_media(
    host: HostDivergence,
    *,
    prefix: str,
    log_histogram: bool = True,
    max_histogram_tokens: int = 50000,
    log_worst_tokens: bool = True,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """``{prefix + "per_token_diff_hist": wandb.Histogram, prefix + "worst_tokens": wandb.Table}``.

    Both are left out when there are no action tokens (or when switched off).
    """
    media: dict[str, Any] = {}
    if host.totals["n_action_tokens"] == 0:
        return media
    if log_histogram and host.diffs.size:
        import wandb

        media[prefix + HISTOGRAM_KEY] = wandb.Histogram(histogram_values(host.diffs, max_histogram_tokens))
    if log_worst_tokens:
        import wandb

        media[prefix + TABLE_KEY] = wandb.Table(
            columns=list(WORST_TOKEN_COLUMNS),
            data=worst_token_rows(host.worst, tokenizer),  # every column one type: the token column is text
        )
    return media
