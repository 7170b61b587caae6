"""One channel for what a run tells its user: each warning once per run, from rank 0 only.

Every user-facing warning of the callbacks and DataModules goes through a ``RunWarnings``: a
Python ``UserWarning`` (so ``pytest.warns`` and ``-W error`` work) emitted on global rank 0 only,
at most once per key, however many steps or ranks hit the same problem. ``reset`` starts a new
run (the callback calls it in ``setup``).

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

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["RunWarnings"]


class RunWarnings:
    """Warnings deduplicated by key within a run, shown on rank 0 only."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def warn(self, key: str, message: str) -> None:
        """Warn ``message`` unless a warning with ``key`` was already given in this run."""
        if key in self._said:
            return
        self._said.add(key)
        rank_zero_warn(message, category=UserWarning, stacklevel=3)

    def said(self, key: str) -> bool:
        """Whether the warning ``key`` was given in this run."""
        return key in self._said

    def reset(self) -> None:
        """Forget what was said: a new run begins."""
        self._said.clear()
