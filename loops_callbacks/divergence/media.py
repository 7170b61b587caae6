"""The media of a logged step, built once: the per-token-diff histogram's values, the worst-tokens rows
and the strata view.

``step_media`` builds them from the host statistics, whatever the loggers; ``wandb_media`` turns
them into ``wandb.Histogram`` / ``wandb.Table`` (``wandb`` is imported only then), and the sinks
give TensorBoard the same values and rows. The strata view (``StrataView``) is the divergence by
stratum (``strata``): its scalars ``stratum/<name>/<metric>`` and one table with a row per
stratum that had tokens, so the strata can be read side by side.

Example:
    >>> import numpy as np
    >>> from loops_callbacks.divergence.statistics import ROW, HostDivergence
    >>> host = HostDivergence(totals={"n_action_tokens": 2.0}, extrema={}, worst=np.zeros((0, ROW.WIDTH)),
    ...                       diffs=np.array([-0.5, 0.0]))
    >>> media = step_media(host, MediaOptions(log_worst_tokens=False))
    >>> media.histogram.tolist(), media.worst_rows
    ([-0.5, 0.0], None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from loops_callbacks.divergence.metrics import histogram_values
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.divergence.strata import STRATUM_METRICS, stratum_scalars
from loops_callbacks.divergence.worst_tokens import WORST_TOKEN_COLUMNS, Tokenizer, worst_token_rows

__all__ = [
    "HISTOGRAM_KEY",
    "STRATA_COLUMNS",
    "STRATA_TABLE_KEY",
    "TABLE_KEY",
    "MediaOptions",
    "StepMedia",
    "StrataView",
    "step_media",
    "strata_markdown",
    "wandb_media",
    "wandb_strata",
]

HISTOGRAM_KEY = "per_token_diff_hist"
TABLE_KEY = "worst_tokens"
STRATA_TABLE_KEY = "strata"
STRATA_COLUMNS = ("stratum",) + STRATUM_METRICS


@dataclass(frozen=True)
class MediaOptions:
    """What to build beside the scalars, and how.

    ``max_histogram_tokens`` caps the histogram's values (evenly subsampled; <= 0: no cap);
    ``tokenizer`` (anything with ``decode(list[int]) -> str``) shows the table's tokens as text.
    """

    log_histogram: bool = True
    max_histogram_tokens: int = 50000
    log_worst_tokens: bool = True
    tokenizer: Tokenizer | None = None


@dataclass(frozen=True)
class StrataView:
    """The divergence by stratum of one step: its scalars (bare names) and one row per stratum with tokens."""

    scalars: dict[str, float]
    rows: list[list[Any]]


@dataclass(frozen=True)
class StepMedia:
    """A step's histogram values, table rows and strata view; ``None`` for what is off or empty."""

    histogram: np.ndarray | None = None
    worst_rows: list[list[Any]] | None = None
    strata: StrataView | None = None


def step_media(host: HostDivergence, options: MediaOptions) -> StepMedia:
    """The histogram's values and the table's rows; neither without action tokens (or when switched off)."""
    if host.totals["n_action_tokens"] == 0:
        return StepMedia()
    histogram = None
    if options.log_histogram and host.diffs.size:
        histogram = histogram_values(host.diffs, options.max_histogram_tokens)
    rows = worst_token_rows(host.worst, options.tokenizer) if options.log_worst_tokens else None
    return StepMedia(histogram, rows, _strata_view(host))


def _strata_view(host: HostDivergence) -> StrataView | None:
    if host.strata is None:
        return None
    rows = [
        [name, *(float(getattr(stratum, metric)) for metric in STRATUM_METRICS)]
        for name, stratum in host.strata.items()
        if stratum.n_tokens
    ]
    return StrataView(stratum_scalars(host.strata), rows)


def strata_markdown(view: StrataView) -> str:
    """The strata table as Markdown (TensorBoard's text panel renders it).

    Example:
        >>> print(strata_markdown(StrataView({}, [["pos_q1", 0.05, 0.5, 1.0, 2.0]])))
        | stratum | k3 | abs_d_mean | is_ratio_mean | n_tokens |
        |---|---|---|---|---|
        | pos_q1 | 0.05 | 0.5 | 1 | 2 |
    """
    lines = ["| " + " | ".join(STRATA_COLUMNS) + " |", "|" + "---|" * len(STRATA_COLUMNS)]
    for name, *numbers in view.rows:
        lines.append("| " + " | ".join([name, *(f"{number:.6g}" for number in numbers)]) + " |")
    return "\n".join(lines)


def wandb_media(media: StepMedia, *, prefix: str) -> dict[str, Any]:
    """``{prefix + "per_token_diff_hist": wandb.Histogram, prefix + "worst_tokens": wandb.Table}``, those there are.

    Example:
        >>> wandb_media(StepMedia(), prefix="div/")
        {}
    """
    logged: dict[str, Any] = {}
    if media.histogram is not None:
        import wandb

        logged[prefix + HISTOGRAM_KEY] = wandb.Histogram(media.histogram)
    if media.worst_rows is not None:
        import wandb

        # one type per column: the token column is text
        logged[prefix + TABLE_KEY] = wandb.Table(columns=list(WORST_TOKEN_COLUMNS), data=media.worst_rows)
    return logged


def wandb_strata(view: StrataView, *, prefix: str) -> dict[str, Any]:
    """The strata view for W&B: its scalars and a ``wandb.Table`` under ``prefix + "strata"``."""
    import wandb

    table = wandb.Table(columns=list(STRATA_COLUMNS), data=view.rows)
    return {**{prefix + name: value for name, value in view.scalars.items()}, prefix + STRATA_TABLE_KEY: table}
