"""Reference logprobs: who scores them, how datums get them, and how a run scores them once.

In data-flow order: ``packing`` (token sequences packed once, padded batches built on the
device), ``heads`` (target logprobs from a model's output head in row chunks), ``scorer``
(``TokenScorer``, the batched loop), ``clients`` (the ``SamplingClient`` protocol and
``TorchSamplingClient``), ``policy`` (``PolicyReference``: the policy itself, in place under the
training strategy), ``fingerprint`` (the weights' fingerprint, however they are sharded),
``config`` (``ReferenceConfig``, and what a ``reference`` setting scores with), ``attach``
(``attach_reference_logprobs``, the Loops SDK helper), ``cache`` and ``cache_tool`` (one
safetensors file per key), ``collectives`` and ``rank_agreement`` (the process group, a stalled
rank named, ranks that hold other data stopped), ``across_ranks`` (``score_across_ranks``: packed
token ids in, one float32 array out, scored once across ranks and cached).

DPO pairs are checked before they reach this package, in ``loops_callbacks.data``.

Examples:
    >>> from loops_callbacks.reference import TorchSamplingClient, attach_reference_logprobs
    >>> TorchSamplingClient.__name__, attach_reference_logprobs.__name__
    ('TorchSamplingClient', 'attach_reference_logprobs')
"""

from loops_callbacks.reference.across_ranks import (
    ReferenceCacheError,
    ReferenceCacheWarning,
    ReferenceLogprobsReport,
    score_across_ranks,
)
from loops_callbacks.reference.attach import attach_reference_logprobs
from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient
from loops_callbacks.distributed import RankStalledError
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.policy import PolicyReference
from loops_callbacks.reference.rank_agreement import RanksDisagreeError

__all__ = [
    "PolicyReference",
    "RankStalledError",
    "RanksDisagreeError",
    "ReferenceCacheError",
    "ReferenceCacheWarning",
    "ReferenceConfig",
    "ReferenceLogprobsReport",
    "SamplingClient",
    "TorchSamplingClient",
    "attach_reference_logprobs",
    "score_across_ranks",
]
