"""``ReferenceConfig``: every setting of reference-logprob scoring, in one object from the DataModule to the scorer.

A DataModule (``ReferenceLogprobsMixin.configure_reference``) makes it once, checked; the same
object then reaches ``resolve_reference`` / ``PolicyReference.from_trainer`` (how to build the
scorer: ``scoring_dtype``, ``max_tokens_per_batch``) and ``compute_reference_logprobs`` (how to
score and cache: ``reference_fingerprint``, ``progress``, ``check_prompts``, ``scoring_timeout``).

The cache key is not made of these settings: ``cache_tag`` is what the values depend on besides
the reference's weights and the data, e.g. ``"bfloat16"`` (a reference scored in that dtype),
``"model"`` (in its own dtype) or ``"policy|precision=bf16-mixed"`` (the policy under the
training precision, ``policy.policy_tag``).

Example:
    >>> config = ReferenceConfig(scoring_dtype="bfloat16", max_tokens_per_batch=4096)
    >>> config.cache_tag(), ReferenceConfig().cache_tag()
    ('bfloat16', 'model')
    >>> ReferenceConfig(max_tokens_per_batch=0)
    Traceback (most recent call last):
    ...
    ValueError: max_tokens_per_batch must be an int >= 1, got 0
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

from loops_callbacks.validation import check_dtype, check_int

__all__ = ["DEFAULT_SCORING_TIMEOUT", "SCORING_DTYPES", "ReferenceConfig", "ScoringDtype"]

DEFAULT_SCORING_TIMEOUT = 600.0
"""Seconds a rank waits for the others at each step of reference scoring before naming the ones that stalled."""

ScoringDtype = Literal["float32", "bfloat16", "float16"]
SCORING_DTYPES: tuple[str, ...] = get_args(ScoringDtype)
"""The ``scoring_dtype`` choices (the names of ``ScoringDtype``)."""


@dataclass(frozen=True)
class ReferenceConfig:
    """Settings of reference-logprob scoring; see ``ReferenceLogprobsMixin.configure_reference`` for each field."""

    reference: Any = None
    cache_dir: str | None = None
    use_cache: bool = True
    scoring_dtype: str | None = None
    max_tokens_per_batch: int | None = None
    reference_fingerprint: str | None = None
    progress: bool = True
    check_prompts: bool = True
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT

    def __post_init__(self) -> None:
        if self.scoring_dtype is not None:
            check_dtype("scoring_dtype", self.scoring_dtype, SCORING_DTYPES)
        if self.max_tokens_per_batch is not None:
            check_int("max_tokens_per_batch", self.max_tokens_per_batch, least=1)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir={self.cache_dir!r} must be a path or None")
        if self.reference_fingerprint is not None and not isinstance(self.reference_fingerprint, str):
            raise ValueError(f"reference_fingerprint={self.reference_fingerprint!r} must be a string or None")
        timeout = self.scoring_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"scoring_timeout={timeout!r} must be a number of seconds, or None for no limit")
        if timeout is not None and not timeout > 0:  # NaN too
            raise ValueError(f"scoring_timeout={timeout!r} must be more than 0 seconds, or None for no limit")
        for name in ("use_cache", "progress", "check_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")

    def cache_tag(self) -> str:
        """The cache key's tag for a reference scored with these settings: the scoring dtype, or ``"model"``."""
        return self.scoring_dtype or "model"
