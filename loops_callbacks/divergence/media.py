"""W&B media for the divergence metrics: the per-token-diff histogram and the worst-tokens table.

``wandb`` is imported only when one of them is built.

Example:
    >>> import numpy as np
    >>> from loops_callbacks.divergence.statistics import ROW, HostDivergence
    >>> host = HostDivergence(totals={"n_action_tokens": 0.0}, extrema={}, worst=np.zeros((0, ROW.WIDTH)),
    ...                       diffs=np.zeros(0))
    >>> divergence_media(host, MediaOptions(prefix="div/"))
    {}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loops_callbacks.divergence.metrics import histogram_values
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.divergence.worst_tokens import WORST_TOKEN_COLUMNS, Tokenizer, worst_token_rows

__all__ = ["HISTOGRAM_KEY", "TABLE_KEY", "MediaOptions", "divergence_media"]

HISTOGRAM_KEY = "per_token_diff_hist"
TABLE_KEY = "worst_tokens"


@dataclass(frozen=True)
class MediaOptions:
    """What to build beside the scalars, and how: one object from the callback to every logger.

    ``max_histogram_tokens`` caps the histogram's values (evenly subsampled); ``tokenizer`` (anything
    with ``decode(list[int]) -> str``) shows the table's tokens as text.
    """

    prefix: str
    log_histogram: bool = True
    max_histogram_tokens: int = 50000
    log_worst_tokens: bool = True
    tokenizer: Tokenizer | None = None


def divergence_media(host: HostDivergence, options: MediaOptions) -> dict[str, Any]:
    """``{prefix + "per_token_diff_hist": wandb.Histogram, prefix + "worst_tokens": wandb.Table}``.

    Both are left out when there are no action tokens (or when switched off).
    """
    media: dict[str, Any] = {}
    if host.totals["n_action_tokens"] == 0:
        return media
    if options.log_histogram and host.diffs.size:
        import wandb

        values = histogram_values(host.diffs, options.max_histogram_tokens)
        media[options.prefix + HISTOGRAM_KEY] = wandb.Histogram(values)
    if options.log_worst_tokens:
        import wandb

        media[options.prefix + TABLE_KEY] = wandb.Table(
            columns=list(WORST_TOKEN_COLUMNS),
            data=worst_token_rows(host.worst, options.tokenizer),  # one type per column: the token column is text
        )
    return media
