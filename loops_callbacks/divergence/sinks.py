"""Deliver a step's report to every Lightning logger, each in its own way, in one record per step.

* ``WandbLogger``: the scalars and the breakdown with a ``wandb.Histogram``, the worst-tokens and strata
  ``wandb.Table``s and the diagnosis as HTML, in one ``log_metrics`` call (never ``run.log(step=...)``,
  which W&B silently drops once its own counter is ahead);
* ``TensorBoardLogger``: the scalars, ``add_histogram``, and the tables and the diagnosis as Markdown text;
* any other logger (CSV, MLflow, ...): the scalars.

The media are the report's, built once for every logger. A logger that fails is a warning (once per run
and logger) and is skipped: monitoring never stops training. ``deliver_text`` writes one text (the guard
rail's message, the run's summary) to each logger that can show text.

Examples:
    >>> from loops_callbacks.divergence.report import StepReport
    >>> class Printer:
    ...     def log_metrics(self, metrics, step):
    ...         print(step, metrics)
    >>> deliver([Printer()], StepReport({"n_action_tokens": 0.0}), step=3, prefix="div/")
    3 {'div/n_action_tokens': 0.0}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from loops_callbacks.divergence.report import (
    DIAGNOSIS_KEY, HISTOGRAM_KEY, TABLE_KEY, WORST_TOKEN_COLUMNS, StepReport, escape, html_panel, wandb_media,
)
from loops_callbacks.run_warnings import RunWarnings



def deliver(loggers: Iterable[Any], report: StepReport, *, step: int, prefix: str,
            warnings: RunWarnings | None = None) -> None:
    """Log ``report`` at ``step`` to each logger (module docstring), every key under ``prefix``."""
    scalars = {prefix + name: value for name, value in {**report.scalars, **report.breakdown}.items()}
    texts = {key: worst_tokens_markdown(rows) if key == TABLE_KEY else markdown(columns, rows)
             for key, (columns, rows) in report.tables.items()}
    if report.diagnosis is not None:
        texts[DIAGNOSIS_KEY] = report.diagnosis.message
    for logger in loggers:
        try:
            if isinstance(logger, WandbLogger):
                logger.log_metrics({**scalars, **wandb_media(report, prefix)}, step=step)
                continue
            logger.log_metrics(scalars, step=step)
            if isinstance(logger, TensorBoardLogger):
                if report.histogram is not None:
                    logger.experiment.add_histogram(prefix + HISTOGRAM_KEY, report.histogram, step)
                for key, text in texts.items():
                    logger.experiment.add_text(prefix + key, text, step)
        except Exception as error:  # a full disk, a closed W&B run, a network error
            name = type(logger).__name__
            (warnings or RunWarnings()).warn(
                f"logger:{name}", f"KLSampleTrainMonitor could not log to {name} at step {step}: {error!r}; training "
                "goes on")


def deliver_text(loggers: Iterable[Any], key: str, text: str, *, step: int, warnings: RunWarnings | None = None,
                 preformatted: bool = False) -> None:
    """Write ``text`` under ``key`` at ``step`` to each logger that can show text; others (CSV) are skipped.

    ``TensorBoardLogger``: ``add_text`` (Markdown; ``preformatted`` text is indented into a code block, so
    its lines stay as they are); ``WandbLogger``: a ``wandb.Html`` panel holding it as preformatted HTML.
    A failing logger is a warning, never an error.

    Examples:
        >>> deliver_text([object()], "div/stop", "stopped", step=3)  # a logger without text: nothing
    """
    for logger in loggers:
        try:
            if isinstance(logger, TensorBoardLogger):
                shown = "\n".join("    " + line for line in text.splitlines()) if preformatted else text
                logger.experiment.add_text(key, shown, step)
            elif isinstance(logger, WandbLogger):
                logger.log_metrics({key: html_panel(text)}, step=step)
        except Exception as error:  # a full disk, a closed W&B run
            name = type(logger).__name__
            (warnings or RunWarnings()).warn(
                f"text:{name}", f"KLSampleTrainMonitor could not log {key!r} to {name} at step {step}: {error!r}")


def markdown(columns: Iterable[str], rows: list[list[Any]]) -> str:
    """A Markdown table (TensorBoard's text panel renders it); numbers to 6 significant digits.

    Examples:
        >>> print(markdown(["stratum", "k3", "is_ratio_mean"], [["pos_q1", 0.05, 1.0]]))
        | stratum | k3 | is_ratio_mean |
        |---|---|---|
        | pos_q1 | 0.05 | 1 |
    """
    columns = list(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else f"{c:.6g}" for c in row) + " |" for row in rows]
    return "\n".join(lines)


def worst_tokens_markdown(rows: list[list[Any]]) -> str:
    """The worst-tokens table as Markdown; token and context as code.

    Examples:
        >>> print(worst_tokens_markdown([[1, 0, 2, "9", -0.5, -2.5, -2.0, 0.1353, "a|b"]]))
        | rank | datum | position | token | logp_sampler | logp_trainer | diff | is_weight | context |
        |---|---|---|---|---|---|---|---|---|
        | 1 | 0 | 2 | `9` | -0.5 | -2.5 | -2.0 | 0.1353 | `a\\|b` |
    """
    token = WORST_TOKEN_COLUMNS.index("token")
    cells = [[_code(escape(str(value))) if i == token else str(value) for i, value in enumerate(numbers)]
             + [_code(str(context))] for *numbers, context in rows]  # the context is already escaped
    return markdown(WORST_TOKEN_COLUMNS, cells)


def _code(text: str) -> str:
    """A Markdown code span that survives a table cell: ``|`` escaped, a longer fence around backticks."""
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"
