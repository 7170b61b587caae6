"""Sampler-vs-trainer logprob divergence: from a step's batch to a logged, diagnosed and judged step.

A logged step, in data-flow order (each module one job):

- ``batch``: the step's batch and output read once into a ``FlatBatch``, the one form everything after reads,
  with its per-datum fields, the sampler's prompts and the engine's own facts (``SamplerFacts``);
- ``statistics``: every statistic declared by name with its reduction beside its formula, merged over
  micro-batches, reduced across ranks in two collectives and moved to the host in one transfer; the shadow
  corrections; the logged scalars and the diagnosis' numbers, one formula each;
- ``diagnosis``: the likely cause and what each cause says;
- ``report``: the step's report, built once, its rendering for each logger, and what the monitor says about
  the step's inputs;
- ``guard_rail``: ``GuardRail``, its judgement of a step, patience, action and verdict;
- ``history``: the run's logged steps and summary, and the noise floor it learned;
- ``monitor``: ``KLSampleTrainMonitor``, the callback that connects Lightning's hooks to these.

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
        module = "batch" if name == "SamplerFacts" else "monitor"
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module 'loops_callbacks.divergence' has no attribute {name!r}")
