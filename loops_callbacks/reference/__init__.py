"""Reference logprobs: who scores them, how datums get them, and how a run scores them once.

In data-flow order:

- ``clients``: the ``SamplingClient`` protocol (Tinker's name) and ``TorchSamplingClient``, which
  scores token sequences with a local ``nn.Module`` in token-budgeted batches;
- ``resolve``: what a ``reference`` setting (client, module, checkpoint path, ``None``) scores with;
- ``attach``: ``attach_reference_logprobs``, the Loops SDK helper (batched, async or one by one);
- ``cache``: the fingerprinted, checksummed on-disk cache of the values;
- ``across_ranks``: ``score_across_ranks``, each rank scoring its share, cached and gathered.

DPO pairs are checked before they reach this package, in ``loops_callbacks.data``.

Example:
    >>> from loops_callbacks.reference import TorchSamplingClient, attach_reference_logprobs
    >>> TorchSamplingClient.__name__, attach_reference_logprobs.__name__
    ('TorchSamplingClient', 'attach_reference_logprobs')
"""

from loops_callbacks.reference.across_ranks import ReferenceCacheWarning, ReferenceLogprobsReport, score_across_ranks
from loops_callbacks.reference.attach import attach_reference_logprobs
from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient
from loops_callbacks.reference.resolve import load_reference_checkpoint, resolve_reference

__all__ = [
    "ReferenceCacheWarning",
    "ReferenceLogprobsReport",
    "SamplingClient",
    "TorchSamplingClient",
    "attach_reference_logprobs",
    "load_reference_checkpoint",
    "resolve_reference",
    "score_across_ranks",
]
