"""Rollout corrections (TRL's, verl's, IcePop, off-policy masking) as plain torch functions, no Lightning.

- ``spec``: ``Correction`` (a method and its parameters, with the framework's defaults) and
  ``parse_correction`` (``"sequence_mask:3.0"``, ``"token_truncate(clip_max=2.0)"``);
- ``compute``: ``apply_correction`` (padded ``[B, T]`` in, ``CorrectionResult`` out), and the same
  on concatenated positions (``correct_flat`` / ``correct_rows``) for the monitor's shadow statistics.

Examples:
    >>> import torch
    >>> sampler = torch.tensor([[-1.0, 0.0]])
    >>> result = apply_correction("token_truncate:2.0", torch.zeros(1, 2), sampler, torch.ones(1, 2))
    >>> result.weights.tolist(), result.clipped.tolist()
    ([[2.0, 1.0]], [[True, False]])
"""

from loops_callbacks.correction.compute import CorrectionResult, apply_correction
from loops_callbacks.correction.spec import METHODS, Correction, parse_correction

__all__ = ["METHODS", "Correction", "CorrectionResult", "apply_correction", "parse_correction"]
