"""The two facts of Lightning's training loop the monitor needs, read in this one place.

Lightning has no public API for either, so they are read directly, as Lightning's own
``LearningRateMonitor`` and ``ThroughputMonitor`` read loop internals:

* ``fit_loop.epoch_loop._batches_that_stepped``: the optimizer step a micro-batch belongs to, the
  step Lightning logs its own metrics under;
* ``fit_loop._should_accumulate()``: whether more micro-batches follow before the optimizer steps.

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

import lightning
import lightning.pytorch as pl

__all__ = ["accumulating", "check_loop_internals", "optimizer_step_index"]


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
