"""One channel for what the package tells its user: warnings on rank 0 only, once per run where asked.

Every user-facing warning of the callbacks, the DataModules and the reference scorer goes through
``warn`` (a Python warning, so ``pytest.warns`` and ``-W error`` work, with a category a user can
filter: ``ReferenceCacheWarning``, ``PreferenceDataWarning``, ...), emitted on global rank 0 only
(Lightning's rank, else ``torch.distributed``'s, else the process is rank 0). ``RunWarnings`` adds
"at most once per key" for what may recur every step; ``reset`` starts a new run (the callback
calls it in ``setup``). Lightning is not imported here, so the plain functions stay light.

Example:
    >>> import warnings
    >>> channel = RunWarnings()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     channel.warn("nan", "every logprob is NaN")
    ...     channel.warn("nan", "every logprob is NaN")
    >>> [str(w.message) for w in caught]
    ['every logprob is NaN']
"""

from __future__ import annotations

import warnings

from lightning_utilities.core.rank_zero import rank_zero_only

__all__ = ["RunWarnings", "warn"]


def warn(message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 3) -> None:
    """Warn ``message`` on global rank 0 only."""
    if _global_rank() == 0:
        warnings.warn(message, category, stacklevel=stacklevel)


class RunWarnings:
    """Warnings deduplicated by key within a run, shown on rank 0 only."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def warn(self, key: str, message: str, category: type[Warning] = UserWarning) -> None:
        """Warn ``message`` unless a warning with ``key`` was already given in this run."""
        if key in self._said:
            return
        self._said.add(key)
        warn(message, category, stacklevel=4)

    def said(self, key: str) -> bool:
        """Whether the warning ``key`` was given in this run."""
        return key in self._said

    def reset(self) -> None:
        """Forget what was said: a new run begins."""
        self._said.clear()


def _global_rank() -> int:
    rank = getattr(rank_zero_only, "rank", None)  # set by Lightning's strategies
    if rank is not None:
        return int(rank)
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
