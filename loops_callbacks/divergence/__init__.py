"""Sampler-vs-trainer logprob divergence: from a batch's fields to a logged step and the guard rail.

In data-flow order:

- ``step_input``: ``read_step``, a training step's batch and output (either contract form) into
  one ``FlatBatch``;
- ``action_tokens``: reads each field (``loops_callbacks.fields``) and flattens a batch's action
  tokens once, on the trainer logprobs' device (``list[Datum]`` or padded ``[B, T]``);
- ``token_context``: the token ids around a position, for the worst-tokens table;
- ``layout``: every statistic declared once by name with its reduction, and the one packing of
  named parts that the host transfer and the collectives use;
- ``statistics``: ``DivergenceStats``, mergeable sums, counts, maxima, worst rows and a diff sample
  (across micro-batches), and ``HostDivergence``, their one host copy;
- ``reduction``: the same statistics across ranks, in two collectives of a size that does not
  grow with the number of ranks;
- ``metrics``: every formula of the logged scalars, once;
- ``signatures``, ``diagnosis``: the evidence numbers of each likely cause, and the rule naming it;
- ``guard_rail``: judging a logged step (above the bound, or not to be trusted);
- ``worst_tokens``, ``media``: the worst-tokens rows and the histogram's values, built once;
- ``report``: ``step_report``, the one pure function from a step's host statistics to its report
  (scalars, likely cause, media, the guard rail's judgement);
- ``sinks``: delivery of a report to each Lightning logger;
- ``lightning_loop``: the two Lightning loop internals the callback reads, checked at setup;
- ``monitor``: ``KLSampleTrainMonitor``, the Lightning callback.

Example:
    >>> from loops_callbacks.divergence import KLSampleTrainMonitor
    >>> KLSampleTrainMonitor(max_kl=0.05, kl_metric="optim/train-sample-div/kl_sample_train_k3").kl_metric
    'kl_sample_train_k3'
"""

__all__ = ["KLSampleTrainMonitor", "SampleTrainDivergenceError"]


def __getattr__(name: str) -> object:
    """The Lightning callback is imported on first use (the statistics need no Lightning)."""
    if name in __all__:
        from loops_callbacks.divergence import monitor

        return getattr(monitor, name)
    raise AttributeError(f"module 'loops_callbacks.divergence' has no attribute {name!r}")
