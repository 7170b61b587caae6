"""What the package tells its user: Lightning's ``rank_zero_warn`` (global rank 0 only), once per key where asked.

``warn(message, category)`` is a Python warning (``pytest.warns`` and ``-W error`` work) with a
category a user can filter (``ReferenceCacheWarning``, ``PreferenceDataWarning``, ...), shown on
global rank 0 only. Outside a Lightning run the rank is torchrun's ``RANK``, else
``torch.distributed``'s, else 0. ``RunWarnings`` adds "at most once per key" for what may recur
every step; ``reset`` starts a new run. Only ``lightning_utilities`` is imported, so the plain
functions stay light.

Examples:
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

import os

from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn

__all__: list[str] = []  # the package's one warning channel: nothing here is for users to import


def warn(message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 3) -> None:
    """Warn ``message`` on global rank 0 only, attributed ``stacklevel`` frames up from the caller of ``warn``."""
    if getattr(rank_zero_only, "rank", None) is None:  # not set by a Lightning strategy
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        rank_zero_only.rank = int(os.environ.get("RANK", dist.get_rank() if initialized else 0))
    rank_zero_warn(message, category=category, stacklevel=stacklevel + 3)  # its 3 frames


class RunWarnings:
    """Warnings deduplicated by key within a run, shown on rank 0 only."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def warn(self, key: str, message: str, category: type[Warning] = UserWarning) -> None:
        """Warn ``message`` unless a warning with ``key`` was already given in this run."""
        if key not in self._said:
            self._said.add(key)
            warn(message, category, stacklevel=4)

    def said(self, key: str) -> bool:
        """Whether the warning ``key`` was given in this run."""
        return key in self._said

    def reset(self) -> None:
        """Forget what was said: a new run begins."""
        self._said.clear()
