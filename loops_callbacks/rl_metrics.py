"""``loops_compute_kl_sample_train`` and ``loops_log_kl_sample_train``, as in the Loops SDK (``loops.rl_metrics``).

Both read the batch once into its statistics (``loops_callbacks.divergence``: ``flatten_datums``,
``DivergenceStats``), turn them into the metrics dict (``statistics``) and, for the logging variant,
build the W&B histogram and worst-tokens table.

Examples:
    >>> import torch
    >>> from loops_callbacks.types import Datum, ModelInput
    >>> datum = Datum(ModelInput.from_ints([1, 2, 3]), {"logprobs": [None, -1.0, -2.0], "mask": [0.0, 1.0, 1.0]})
    >>> metrics = loops_compute_kl_sample_train([datum], [torch.tensor([0.0, -1.5, -2.0])])
    >>> metrics["optim/train-sample-div/kl_sample_train_v1_loops"]
    0.25
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from loops_callbacks.divergence.batch import flatten_datums
from loops_callbacks.divergence.guard_rail import GuardRail
from loops_callbacks.divergence.batch import trainer_logprobs_from_output
from loops_callbacks.divergence.statistics import DEFAULT_PREFIX
from loops_callbacks.divergence.report import (
    MediaOptions,
    ReportOptions,
    Tokenizer,
    checked_tokenizer,
    step_report,
    wandb_media,
)
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions

__all__ = ["loops_compute_kl_sample_train", "loops_log_kl_sample_train"]

logger = logging.getLogger("loops_callbacks")


def loops_compute_kl_sample_train(
    data: Sequence[Any], training_logprobs: Sequence[Any] | torch.Tensor, *, prefix: str = DEFAULT_PREFIX
) -> dict[str, float]:
    """Sampler-vs-trainer divergence scalars over the action tokens of ``data``.

    ``data`` are Loops / Tinker datums carrying the sampler's ``logprobs`` and a ``mask`` (optional
    ``advantages``); ``training_logprobs`` holds the trainer's logprobs, one row per datum (or one
    right-padded ``[B, T]`` tensor). The keys and their formulas are listed in
    ``loops_callbacks.divergence.statistics``. Impossible inputs (a logprob of -inf or +inf on an action
    token, above 0 beyond rounding or below -1e4, trainer logprobs all exactly 0.0) are logged as
    warnings on the ``loops_callbacks`` logger, naming the side and how many; the numbers are returned
    anyway. A negative or NaN ``mask`` is a ``ValueError`` naming the datum and position.
    """
    return _report(data, training_logprobs, MediaOptions(log_histogram=False, log_worst_tokens=False), prefix)[0]


def loops_log_kl_sample_train(
    wandb_run: Any,
    step: int,
    data: Sequence[Any],
    forward_backward_output: Any = None,
    *,
    training_logprobs: Sequence[Any] | torch.Tensor | None = None,
    prefix: str = DEFAULT_PREFIX,
    log_histogram: bool = True,
    max_histogram_tokens: int = 50000,
    log_worst_tokens: bool = True,
    top_n: int = 20,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """Compute the divergence metrics, add a diff histogram and a worst-tokens table, log to W&B.

    ``training_logprobs`` wins when given, else they are read from
    ``forward_backward_output.loss_fn_outputs[i]["logprobs"]``. ``wandb_run`` is anything with
    ``.log(metrics, step=...)`` or ``None``; the dict is returned either way. A failing
    ``wandb_run.log`` is logged as a warning, never raised: monitoring must not stop training.
    """
    media = MediaOptions(log_histogram, max_histogram_tokens, log_worst_tokens, top_n)
    tokenizer = checked_tokenizer(tokenizer)
    if training_logprobs is None:
        if forward_backward_output is None:
            raise ValueError("pass either forward_backward_output or training_logprobs")
        training_logprobs = trainer_logprobs_from_output(forward_backward_output)
    scalars, report = _report(data, training_logprobs, media, prefix, tokenizer)
    try:
        media = wandb_media(report, prefix)
    except Exception as error:  # monitoring must never break training: the scalars still come back
        logger.warning("could not make the divergence media (histogram, tables) at step %s: %r", step, error)
        media = {}
    metrics: dict[str, Any] = {**scalars, **media}
    if wandb_run is not None:
        try:
            wandb_run.log(metrics, step=step)
        except Exception as error:  # monitoring must never break training
            logger.warning("could not log divergence metrics to W&B at step %s: %r", step, error)
    return metrics


def _report(
    data: Sequence[Any], training_logprobs: Any, media: MediaOptions, prefix: str, tokenizer: Tokenizer | None = None,
) -> tuple[dict[str, float], Any]:
    """The batch's metrics (under ``prefix``) and report, impossible inputs logged as warnings.

    The plain functions report no diagnosis, so neither its token ids nor its sums are read.
    """
    flat = flatten_datums(data, training_logprobs, with_tokens=media.rows > 0, diagnose=False)
    host = DivergenceStats.from_batch(flat, StatisticsOptions(top_n=media.rows, diagnose=False)).to_host()
    report = step_report(host, ReportOptions(media=media, diagnose=False, tokenizer=tokenizer, prefix=prefix),
                         guard_rail=GuardRail())
    for message in report.problems.values():
        logger.warning("%s", message)
    return {prefix + name: value for name, value in report.scalars.items()}, report
