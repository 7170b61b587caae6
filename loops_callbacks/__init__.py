"""Lightning plugins for RL post-training, with the Baseten Loops SDK helpers' names and results."""

from loops_callbacks.callbacks import KLSampleTrainMonitor, SampleTrainDivergenceError
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.rl_metrics import loops_compute_kl_sample_train, loops_log_kl_sample_train
from loops_callbacks.sampling import SamplingClient, TorchSamplingClient
from loops_callbacks.types import Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, TensorData

__all__ = [
    "Datum",
    "KLSampleTrainMonitor",
    "SampleTrainDivergenceError",
    "SamplingClient",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ModelInput",
    "TensorData",
    "TorchSamplingClient",
    "attach_reference_logprobs",
    "loops_compute_kl_sample_train",
    "loops_log_kl_sample_train",
]
