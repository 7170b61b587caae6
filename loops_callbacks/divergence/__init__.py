"""Sampler-vs-trainer logprob divergence: from a batch's fields to a logged step and the guard rail.

In data-flow order:

- ``action_tokens``: reads each field (``loops_callbacks.fields``) and flattens a batch's action
  tokens once, on the trainer logprobs' device (``list[Datum]`` or padded ``[B, T]``);
- ``token_context``: the token ids around a position, for the worst-tokens table;
- ``statistics``: ``DivergenceStats``, mergeable sums, counts, maxima, worst rows and a diff sample
  (across micro-batches and ranks), and ``HostDivergence``, their one host copy;
- ``metrics``: every formula of the logged scalars, once;
- ``worst_tokens``, ``media``: the worst-tokens table and the W&B histogram and table;
- ``sinks``: delivery to each Lightning logger;
- ``monitor``: ``KLSampleTrainMonitor``, the Lightning callback, and its guard rail.

Example:
    >>> from loops_callbacks.divergence import KLSampleTrainMonitor
    >>> KLSampleTrainMonitor(max_kl=0.05).kl_key
    'optim/train-sample-div/kl_sample_train_k3'
"""

__all__ = ["KLSampleTrainMonitor", "SampleTrainDivergenceError"]


def __getattr__(name: str) -> object:
    """The Lightning callback is imported on first use (the statistics need no Lightning)."""
    if name in __all__:
        from loops_callbacks.divergence import monitor

        return getattr(monitor, name)
    raise AttributeError(f"module 'loops_callbacks.divergence' has no attribute {name!r}")
