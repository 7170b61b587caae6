"""``ReferenceConfig``: every setting of reference-logprob scoring; ``ScoringOptions``: one scoring run's options.

A DataModule (``ReferenceLogprobsMixin.configure_reference``) makes a ``ReferenceConfig`` once,
checked; the same object then reaches ``resolve_reference`` / ``PolicyReference.from_trainer``
(how to build the scorer: ``scoring_dtype``, ``max_tokens_per_batch``). How to score and cache is
one ``ScoringOptions``, made from it once (``ReferenceConfig.scoring_options``) with what only the
run knows (the cache's path, the key's tag, the datums kept together on a rank, how errors name a
datum) and handed whole to ``score_packed_across_ranks``.

The cache key is not made of these settings: ``cache_tag`` is what the values depend on besides
the reference's weights and the data, e.g. ``"bfloat16"`` (a reference scored in that dtype),
``"model"`` (in its own dtype) or ``"policy|precision=bf16-mixed"`` (the policy under the
training precision, ``policy.policy_tag``).

Example:
    >>> config = ReferenceConfig(scoring_dtype="bfloat16", max_tokens_per_batch=4096)
    >>> config.cache_tag(), ReferenceConfig().cache_tag()
    ('bfloat16', 'model')
    >>> options = config.scoring_options(cache_path="cache/reference_logprobs.npz", shard_unit=2)
    >>> options.cache_tag, options.shard_unit, options.scoring_timeout
    ('bfloat16', 2, 600.0)
    >>> ReferenceConfig(max_tokens_per_batch=0)
    Traceback (most recent call last):
    ...
    ValueError: max_tokens_per_batch must be an int >= 1, got 0
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from loops_callbacks.validation import check_bool, check_dtype, check_int

__all__ = ["DEFAULT_SCORING_TIMEOUT", "SCORING_DTYPES", "ReferenceConfig", "ScoringDtype", "ScoringOptions"]

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
        _check_timeout(self.scoring_timeout)
        for name in ("use_cache", "progress", "check_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")

    def cache_tag(self) -> str:
        """The cache key's tag for a reference scored with these settings: the scoring dtype, or ``"model"``."""
        return self.scoring_dtype or "model"

    def scoring_options(
        self,
        *,
        cache_path: str | os.PathLike[str] | None = None,
        cache_tag: str | None = None,
        cached_only: str | None = None,
        shard_unit: int = 1,
        datum_name: Callable[[int], str] | None = None,
    ) -> ScoringOptions:
        """The options of a scoring run with these settings (their fingerprint, progress bar, timeout and, unless
        ``cache_tag`` is given, ``cache_tag()``), and what only the run knows (see ``ScoringOptions``)."""
        return ScoringOptions(
            cache_path=cache_path,
            reference_fingerprint=self.reference_fingerprint,
            cache_tag=cache_tag if cache_tag is not None else self.cache_tag(),
            progress=self.progress,
            shard_unit=shard_unit,
            cached_only=cached_only,
            scoring_timeout=self.scoring_timeout,
            datum_name=datum_name,
        )


@dataclass(frozen=True)
class ScoringOptions:
    """How one run of ``score_packed_across_ranks`` scores and caches, made once and handed on whole.

    Each field is the ``score_across_ranks`` keyword of the same name (and default): ``cache_path``
    (the cache's base path; ``None``: no cache), ``reference_fingerprint`` (the identity of a
    reference without ``fingerprint()``), ``cache_tag`` (what the values depend on besides the
    weights and the data), ``progress``, ``shard_unit`` (datums kept together on one rank),
    ``cached_only`` (never score: why the cache must hold the values), ``scoring_timeout`` and
    ``datum_name`` (how an error names datum ``i``; ``None``: ``datum i``).

    ``ReferenceConfig`` is what the user sets; these are what one run needs, some resolved from it
    (``ReferenceConfig.scoring_options``) and some known only to the run: the cache's path (the
    directory and the trainer's root), the tag (a policy's precision), a DPO pair's two sequences
    kept together, a resumed run's ``cached_only``. Each field is checked when made: a wrong type is a
    ``TypeError``, a value out of range a ``ValueError``, naming the field and the value.

    Example:
        >>> ScoringOptions(cache_path="cache/ref.npz", shard_unit=2).cache_tag
        'model'
        >>> ScoringOptions(shard_unit=0)
        Traceback (most recent call last):
        ...
        ValueError: shard_unit must be an int >= 1, got 0
    """

    cache_path: str | None = None
    reference_fingerprint: str | None = None
    cache_tag: str = "model"
    progress: bool = True
    shard_unit: int = 1
    cached_only: str | None = None
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT
    datum_name: Callable[[int], str] | None = None

    def __post_init__(self) -> None:
        if self.cache_path is not None:
            if not isinstance(self.cache_path, (str, os.PathLike)):
                raise TypeError(f"cache_path must be a path or None, got {self.cache_path!r}")
            object.__setattr__(self, "cache_path", os.fspath(self.cache_path))
        for name in ("reference_fingerprint", "cached_only"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string or None, got {getattr(self, name)!r}")
        if not isinstance(self.cache_tag, str) or not self.cache_tag:
            error = ValueError if isinstance(self.cache_tag, str) else TypeError
            raise error(f"cache_tag must be a non-empty string, got {self.cache_tag!r}")
        check_bool("progress", self.progress)
        check_int("shard_unit", self.shard_unit, least=1)
        _check_timeout(self.scoring_timeout)
        if self.datum_name is not None and not callable(self.datum_name):
            raise TypeError(f"datum_name must be a callable (datum index -> name) or None, got {self.datum_name!r}")


def _check_timeout(timeout: Any) -> None:
    """A ``TypeError`` / ``ValueError`` naming ``scoring_timeout`` unless it is seconds > 0 or ``None`` (no limit)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
        raise TypeError(f"scoring_timeout={timeout!r} must be a number of seconds, or None for no limit")
    if timeout is not None and not timeout > 0:  # NaN too
        raise ValueError(f"scoring_timeout={timeout!r} must be more than 0 seconds, or None for no limit")
