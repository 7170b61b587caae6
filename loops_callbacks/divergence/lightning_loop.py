"""The facts of Lightning's training loop the monitor needs, read in this one place.

Lightning has no public API for the first two, so they are read directly, as Lightning's own
``LearningRateMonitor`` and ``ThroughputMonitor`` read loop internals:

* ``fit_loop.epoch_loop._batches_that_stepped``: the optimizer step a micro-batch belongs to, the
  step Lightning logs its own metrics under;
* ``fit_loop._should_accumulate()``: whether more micro-batches follow before the optimizer steps;
* the fit's last optimizer step, from the public ``Trainer.estimated_stepping_batches``.

``check_loop_internals`` runs at ``setup``: if a Lightning release renames them, the monitor fails
there with the Lightning version in the message, instead of logging every micro-batch or under
the wrong step. The tested range is declared in ``pyproject.toml``.

Example:
    >>> import lightning
    >>> trainer = lightning.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    >>> check_loop_internals(trainer)
    >>> optimizer_step_index(trainer)
    0
"""

from __future__ import annotations

import math

import lightning
import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = ["accumulating", "check_loop_internals", "last_optimizer_step", "optimizer_step_index"]


def check_loop_internals(trainer: pl.Trainer) -> None:
    """``RuntimeError`` naming the Lightning version when the loop attributes read here are gone."""
    epoch_loop = trainer.fit_loop.epoch_loop
    missing = [
        name
        for name, present in (
            ("fit_loop.epoch_loop._batches_that_stepped", isinstance(getattr(epoch_loop, "_batches_that_stepped", None), int)),
            ("fit_loop.epoch_loop._should_accumulate()", callable(getattr(epoch_loop, "_should_accumulate", None))),
        )
        if not present
    ]
    if missing:
        raise RuntimeError(
            f"KLSampleTrainMonitor reads {missing} of Lightning's training loop, which Lightning "
            f"{lightning.__version__} does not have; install a Lightning version in the range loops-callbacks "
            "declares (pip install 'lightning>=2.6,<2.7'), or report the new name"
        )


def optimizer_step_index(trainer: pl.Trainer) -> int:
    """The 0-based optimizer step this micro-batch belongs to: the step Lightning logs it under."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether more micro-batches follow before the optimizer steps (Lightning's own rule)."""
    if not trainer.lightning_module.automatic_optimization:
        return False
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def last_optimizer_step(trainer: pl.Trainer) -> int | None:
    """The 0-based index of the fit's last optimizer step (``max_steps``, or the epochs' batches), or ``None``
    when Lightning cannot tell it (an endless stream without ``max_steps``, an accumulation schedule)."""
    try:
        steps = trainer.estimated_stepping_batches
    except MisconfigurationException:
        return None
    return int(steps) - 1 if math.isfinite(steps) and steps >= 1 else None
