"""Lightning plugins for RL post-training, with the Baseten Loops SDK helpers' names and results."""

from loops_callbacks.types import Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, TensorData

__all__ = ["Datum", "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput", "TensorData"]
