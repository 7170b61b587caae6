"""Reference logprobs: who scores them, how datums get them, and how a run scores them once.

In data-flow order:

- ``packing``: token sequences packed once into flat arrays; padded batches built on the device;
- ``heads``: target logprobs from a model's output head in row chunks (no ``[B, T, V]`` logits),
  or from its logits (the general path);
- ``config``: ``ReferenceConfig``, every scoring setting in one object, and the cache tag;
  ``ScoringOptions``, one scoring run's options, handed whole to ``score_packed_across_ranks``;
- ``scorer``: ``TokenScorer``, the batched, device-resident loop (lock-step across ranks);
- ``clients``: the ``SamplingClient`` protocol (Tinker's name) and ``TorchSamplingClient``, which
  scores token sequences with a local ``nn.Module`` (or a callable) in token-budgeted batches;
- ``policy``: ``PolicyReference``, the policy itself as the DPO reference, used in place under the
  training strategy (no copy of the weights);
- ``fingerprint``: the weights' fingerprint, the same however they are placed or sharded;
- ``resolve``: what a ``reference`` setting (client, module, callable, checkpoint path, ``None``) scores with;
- ``attach``: ``attach_reference_logprobs``, the Loops SDK helper (batched, async or one by one);
- ``cache``: the fingerprinted, checksummed on-disk cache of the values, read into memory;
- ``collectives``: the process-group operations, values as tensors;
- ``across_ranks``: ``score_packed_across_ranks``, each rank scoring its share of packed token ids,
  cached and gathered into one float32 array; ``score_across_ranks``, the same for datums.

DPO pairs are checked before they reach this package, in ``loops_callbacks.data``.

Example:
    >>> from loops_callbacks.reference import TorchSamplingClient, attach_reference_logprobs
    >>> TorchSamplingClient.__name__, attach_reference_logprobs.__name__
    ('TorchSamplingClient', 'attach_reference_logprobs')
"""

from loops_callbacks.reference.across_ranks import (
    ReferenceCacheError,
    ReferenceCacheWarning,
    ReferenceLogprobsReport,
    score_across_ranks,
    score_packed_across_ranks,
)
from loops_callbacks.reference.attach import attach_reference_logprobs
from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient
from loops_callbacks.reference.collectives import RankStalledError
from loops_callbacks.reference.config import ReferenceConfig, ScoringOptions
from loops_callbacks.reference.policy import PolicyReference
from loops_callbacks.reference.rank_agreement import RanksDisagreeError
from loops_callbacks.reference.resolve import load_reference_checkpoint, resolve_reference

__all__ = [
    "PolicyReference",
    "RankStalledError",
    "RanksDisagreeError",
    "ReferenceCacheError",
    "ReferenceCacheWarning",
    "ReferenceConfig",
    "ReferenceLogprobsReport",
    "SamplingClient",
    "ScoringOptions",
    "TorchSamplingClient",
    "attach_reference_logprobs",
    "load_reference_checkpoint",
    "resolve_reference",
    "score_across_ranks",
    "score_packed_across_ranks",
]
