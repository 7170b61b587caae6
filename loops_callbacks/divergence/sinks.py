"""Deliver one step's report to every Lightning logger, each in its own way.

* ``WandbLogger``: scalars, ``wandb.Histogram`` and ``wandb.Table`` through ``log_metrics``
  (never ``run.log(step=...)``, which W&B silently drops once its own counter is ahead);
* ``TensorBoardLogger``: scalars, ``add_histogram`` and the table as Markdown text;
  (the histogram's values and the table's rows are the report's, built once for every logger);
* any other logger (CSV, MLflow, ...): scalars.

The breakdown of the step goes in a second ``log_metrics`` call at the same step, so the step's
own metrics stay one record: the strata view (``media.StrataView``: ``stratum/<name>/<metric>``
scalars and their table; W&B gets a ``wandb.Table``, TensorBoard a Markdown table) and the
shadow metrics of the monitor's corrections (``correction/...`` scalars, ``shadow``).

``deliver_text`` writes one text entry (e.g. why the guard rail stopped the run) to each logger
that can show text: TensorBoard's text panel (``add_text``, Markdown) and W&B (an HTML panel).

A logger that fails is reported as a warning and skipped: monitoring must never stop training.

Example:
    >>> from loops_callbacks.divergence.report import StepReport
    >>> class Printer:
    ...     def log_metrics(self, metrics, step):
    ...         print(step, metrics)
    >>> deliver([Printer()], StepReport({"n_action_tokens": 0.0}), step=3, prefix="div/")
    3 {'div/n_action_tokens': 0.0}
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from loops_callbacks import run_warnings
from loops_callbacks.divergence.media import (
    HISTOGRAM_KEY,
    STRATA_TABLE_KEY,
    TABLE_KEY,
    strata_markdown,
    wandb_media,
    wandb_strata,
)
from loops_callbacks.divergence.worst_tokens import worst_tokens_markdown
from loops_callbacks.run_warnings import RunWarnings

if TYPE_CHECKING:  # the report module builds what this one delivers
    from loops_callbacks.divergence.report import StepReport

__all__ = ["deliver", "deliver_text"]


def deliver(
    loggers: Iterable[Any],
    report: StepReport,
    *,
    step: int,
    prefix: str,
    warnings: RunWarnings | None = None,
    scalars: dict[str, float] | None = None,
    breakdown: dict[str, float] | None = None,
) -> None:
    """Log ``report``'s scalars (and its media where the logger can show it) at ``step`` to each logger.

    Every key gets ``prefix``; ``scalars`` is ``report.logged(prefix)`` when the caller has it
    (built once per step, whatever the loggers); ``breakdown`` more scalars (bare names) for the
    second record, beside the strata view. A failing logger is a warning, through
    ``warnings`` (once per run and logger) when given.
    """
    if scalars is None:
        scalars = report.logged(prefix)
    for logger in loggers:
        try:
            _deliver_one(logger, report, scalars, step, prefix)
            _deliver_breakdown(logger, report, breakdown or {}, step, prefix)
        except Exception as error:  # a full disk, a closed W&B run, a network error
            _warn(
                warnings,
                f"logger:{type(logger).__name__}",
                f"KLSampleTrainMonitor could not log to {type(logger).__name__} at step {step}: {error!r}; "
                "training goes on",
            )


def deliver_text(
    loggers: Iterable[Any],
    key: str,
    text: str,
    *,
    step: int,
    warnings: RunWarnings | None = None,
    preformatted: bool = False,
) -> None:
    """Write ``text`` under ``key`` at ``step`` to each logger that can show text; others are skipped.

    Used for the guard rail's message, so a stop is visible beside the curves, and for the run's
    summary. ``TensorBoardLogger``: ``add_text`` (the TEXT tab renders Markdown; ``preformatted``
    text is indented into a code block, so its lines and alignment stay as they are);
    ``WandbLogger``: a ``wandb.Html`` panel holding the text as preformatted HTML, through
    ``log_metrics``. Loggers that show no text (CSV) are skipped; a failing logger is a warning,
    never an error.

    Example:
        >>> deliver_text([object()], "div/stop", "stopped", step=3)  # a logger without text: nothing
    """
    for logger in loggers:
        try:
            if isinstance(logger, TensorBoardLogger):
                shown = "\n".join("    " + line for line in text.splitlines()) if preformatted else text
                logger.experiment.add_text(key, shown, step)
            elif isinstance(logger, WandbLogger):
                import wandb

                logger.log_metrics({key: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)
        except Exception as error:  # a full disk, a closed W&B run
            name = type(logger).__name__
            _warn(warnings, f"text:{name}", f"KLSampleTrainMonitor could not log {key!r} to {name} at step {step}: {error!r}")


def _warn(warnings: RunWarnings | None, key: str, message: str) -> None:
    if warnings is None:
        run_warnings.warn(message)
    else:
        warnings.warn(key, message)


def _deliver_one(logger: Any, report: StepReport, scalars: dict[str, float], step: int, prefix: str) -> None:
    if isinstance(logger, WandbLogger):
        logger.log_metrics({**scalars, **wandb_media(report.media, prefix=prefix)}, step=step)
        return
    logger.log_metrics(scalars, step=step)
    if isinstance(logger, TensorBoardLogger):
        writer = logger.experiment
        if report.media.histogram is not None:
            writer.add_histogram(prefix + HISTOGRAM_KEY, report.media.histogram, step)
        if report.media.worst_rows is not None:
            writer.add_text(prefix + TABLE_KEY, worst_tokens_markdown(report.media.worst_rows), step)


def _deliver_breakdown(logger: Any, report: StepReport, breakdown: dict[str, float], step: int, prefix: str) -> None:
    """The second record: the strata view and ``breakdown``'s scalars; nothing when both are empty."""
    view = report.media.strata
    if view is not None and not view.rows:
        view = None
    if view is None and not breakdown:
        return
    scalars = {prefix + name: value for name, value in breakdown.items()}
    if isinstance(logger, WandbLogger):
        logger.log_metrics({**scalars, **(wandb_strata(view, prefix=prefix) if view is not None else {})}, step=step)
        return
    if view is not None:
        scalars.update({prefix + name: value for name, value in view.scalars.items()})
    logger.log_metrics(scalars, step=step)
    if isinstance(logger, TensorBoardLogger) and view is not None:
        logger.experiment.add_text(prefix + STRATA_TABLE_KEY, strata_markdown(view), step)
