"""Deliver one step's divergence metrics to every Lightning logger, each in its own way.

* ``WandbLogger``: scalars, ``wandb.Histogram`` and ``wandb.Table`` through ``log_metrics``
  (never ``run.log(step=...)``, which W&B silently drops once its own counter is ahead);
* ``TensorBoardLogger``: scalars, ``add_histogram`` and the table as Markdown text;
* any other logger (CSV, MLflow, ...): scalars.

A logger that fails is reported as a warning and skipped: monitoring must never stop training.

Example:
    >>> import numpy as np
    >>> from loops_callbacks.divergence.statistics import HostDivergence
    >>> class Printer:
    ...     def log_metrics(self, metrics, step):
    ...         print(step, metrics)
    >>> host = HostDivergence({"n_action_tokens": 0.0}, {}, np.zeros((0, 67)), np.zeros(0))
    >>> deliver([Printer()], {"div/n_action_tokens": 0.0}, host, step=3, media=MediaOptions("div/"))
    3 {'div/n_action_tokens': 0.0}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from loops_callbacks.divergence.media import HISTOGRAM_KEY, TABLE_KEY, divergence_media
from loops_callbacks.divergence.metrics import histogram_values
from loops_callbacks.divergence.statistics import HostDivergence
from loops_callbacks.divergence.worst_tokens import Tokenizer, worst_token_rows, worst_tokens_markdown

__all__ = ["MediaOptions", "deliver", "deliver_text"]


@dataclass(frozen=True)
class MediaOptions:
    """What to build beside the scalars, and how."""

    prefix: str
    log_histogram: bool = True
    max_histogram_tokens: int = 50000
    log_worst_tokens: bool = True
    tokenizer: Tokenizer | None = None


def deliver(
    loggers: Iterable[Any], scalars: Mapping[str, float], host: HostDivergence, *, step: int, media: MediaOptions
) -> None:
    """Log ``scalars`` (and media where the logger can show it) at ``step`` to each logger."""
    for logger in loggers:
        try:
            _deliver_one(logger, scalars, host, step, media)
        except Exception as error:  # a full disk, a closed W&B run, a network error
            rank_zero_warn(
                f"KLSampleTrainMonitor could not log to {type(logger).__name__} at step {step}: {error!r}; "
                "training goes on"
            )


def _deliver_one(logger: Any, scalars: Mapping[str, float], host: HostDivergence, step: int, media: MediaOptions) -> None:
    if isinstance(logger, WandbLogger):
        extra = divergence_media(
            host,
            prefix=media.prefix,
            log_histogram=media.log_histogram,
            max_histogram_tokens=media.max_histogram_tokens,
            log_worst_tokens=media.log_worst_tokens,
            tokenizer=media.tokenizer,
        )
        logger.log_metrics({**scalars, **extra}, step=step)
        return
    logger.log_metrics(dict(scalars), step=step)
    if isinstance(logger, TensorBoardLogger) and host.totals["n_action_tokens"] > 0:
        writer = logger.experiment
        if media.log_histogram and host.diffs.size:
            writer.add_histogram(media.prefix + HISTOGRAM_KEY, histogram_values(host.diffs, media.max_histogram_tokens), step)
        if media.log_worst_tokens:
            writer.add_text(media.prefix + TABLE_KEY, worst_tokens_markdown(worst_token_rows(host.worst, media.tokenizer)), step)


def deliver_text(loggers: Iterable[Any], key: str, text: str, *, step: int) -> None:
    """Log a line of text at ``step`` where a logger can show it (TensorBoard text, a W&B table).

    Used for the guard rail's message, so a stop is visible beside the curves. Loggers that show
    no text (CSV) are skipped; a failing logger is a warning.

    Example:
        >>> deliver_text([object()], "div/guard_rail", "stopped", step=3)  # nothing to show it: skipped
    """
    for logger in loggers:
        try:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(key, text, step)
            elif isinstance(logger, WandbLogger):
                import wandb

                logger.log_metrics({key: wandb.Table(columns=["step", "message"], data=[[step, text]])}, step=step)
        except Exception as error:  # monitoring never stops training by itself
            rank_zero_warn(f"KLSampleTrainMonitor could not log text to {type(logger).__name__} at step {step}: {error!r}")

