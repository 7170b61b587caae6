"""Lightning plugins for RL post-training, with the Baseten Loops SDK helpers' names and results.

Two pipelines: ``loops_callbacks.divergence`` (sampler-vs-trainer logprob divergence, the
``KLSampleTrainMonitor`` callback and its guard rail) and ``loops_callbacks.reference`` (reference
logprobs for DPO), with ``loops_callbacks.data`` for DPO data (``DPODataModule``, and
``ReferenceLogprobsMixin`` for a DataModule of your own). ``token_logprobs`` is the
one target-token log-probability formula (a ``training_step``'s, the DPO policy's and the reference
scorer's). The SDK's import paths ``loops_callbacks.rl_metrics`` and ``loops_callbacks.helpers.datum``
are kept.

Examples:
    >>> from loops_callbacks import GuardRail, KLSampleTrainMonitor, attach_reference_logprobs
    >>> KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop")).guard_rail.on_exceed
    'stop'
    >>> from loops_callbacks import DPODataModule, ReferenceLogprobsMixin
    >>> issubclass(DPODataModule, ReferenceLogprobsMixin)
    True
"""

import importlib

from loops_callbacks.logprobs import token_logprobs
from loops_callbacks.reference.attach import attach_reference_logprobs
from loops_callbacks.reference.clients import SamplingClient, TorchSamplingClient
from loops_callbacks.rl_metrics import loops_compute_kl_sample_train, loops_log_kl_sample_train
from loops_callbacks.types import Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, TensorData

__all__ = [
    "DPODataModule",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GuardRail",
    "KLSampleTrainMonitor",
    "MediaOptions",
    "ModelInput",
    "ReferenceLogprobsMixin",
    "SampleTrainDivergenceError",
    "SamplerFacts",
    "SamplingClient",
    "TensorData",
    "TorchSamplingClient",
    "attach_reference_logprobs",
    "loops_compute_kl_sample_train",
    "loops_log_kl_sample_train",
    "token_logprobs",
]

_LIGHTNING_NAMES = {
    "KLSampleTrainMonitor": "loops_callbacks.divergence.monitor",
    "GuardRail": "loops_callbacks.divergence.monitor",
    "MediaOptions": "loops_callbacks.divergence.monitor",
    "SampleTrainDivergenceError": "loops_callbacks.divergence.monitor",
    "SamplerFacts": "loops_callbacks.divergence.batch",
    "DPODataModule": "loops_callbacks.data",
    "ReferenceLogprobsMixin": "loops_callbacks.data",
}


def __getattr__(name: str) -> object:
    """The Lightning classes are imported on first use, so the plain functions load without Lightning."""
    if name in _LIGHTNING_NAMES:
        return getattr(importlib.import_module(_LIGHTNING_NAMES[name]), name)
    raise AttributeError(f"module 'loops_callbacks' has no attribute {name!r}")
