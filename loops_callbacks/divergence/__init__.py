"""Sampler-vs-trainer logprob divergence: from a step's batch to a logged, diagnosed and judged step.

A logged step, in data-flow order (each module one job):

- ``batch`` (with ``batch``, ``batch``): the step's batch and output read once into a
  ``FlatBatch``, the one form everything after reads;
- ``statistics`` declares every statistic by name with its reduction, ``statistics`` gives each its formula,
  ``statistics`` merges them over micro-batches and moves them to the host in one transfer, and
  ``statistics`` reduces them across ranks in two collectives (``statistics``: the offset votes;
  ``statistics``: what each listed correction would do);
- ``statistics`` and ``statistics``: the logged scalars and the diagnosis' numbers, one formula each;
- ``diagnosis`` (with ``batch``, ``diagnosis``): the likely cause; ``guard_rail``: whether the step exceeds;
- ``report``: the step's report, built once; ``report``: its delivery to each Lightning logger;
- ``monitor``: ``KLSampleTrainMonitor``, the callback that wires them (``history``: the run's summary,
  ``step_warnings``: what it says about the inputs).

Examples:
    >>> from loops_callbacks import GuardRail, KLSampleTrainMonitor
    >>> rail = GuardRail(max_kl=0.05, kl_metric="optim/train-sample-div/kl_sample_train_k3")
    >>> KLSampleTrainMonitor(guard_rail=rail).guard_rail.kl_metric
    'kl_sample_train_k3'
"""

import importlib

__all__ = ["KLSampleTrainMonitor", "SampleTrainDivergenceError", "SamplerFacts"]


def __getattr__(name: str) -> object:
    """The Lightning callback is imported on first use (the plain functions need no Lightning)."""
    if name in __all__:
        module = "evidence" if name == "SamplerFacts" else "monitor"
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module 'loops_callbacks.divergence' has no attribute {name!r}")
