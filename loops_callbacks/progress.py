"""``ProgressBar``: the one progress display of long data steps (tokenizing, scoring reference logprobs).

It shows a tqdm bar (``progress=True``), calls ``progress(done, total)`` (a callable), or does
nothing (``False``). ``advance(n)`` counts ``n`` more steps, ``reach(done)`` sets the count.

Examples:
    >>> seen = []
    >>> with ProgressBar(lambda done, total: seen.append((done, total)), 4, desc="pairs", unit="pair") as bar:
    ...     bar.advance(1)
    ...     bar.reach(4)
    >>> seen
    [(1, 4), (4, 4)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__: list[str] = []  # the package's one progress display: nothing here is for users to import


class ProgressBar:
    """A tqdm bar, a callable ``progress(done, total)``, or nothing; a context manager that closes the bar."""

    def __init__(
        self, progress: bool | Callable[[int, int], None], total: int, *, desc: str, unit: str, unit_scale: bool = False
    ) -> None:
        from tqdm.auto import tqdm

        self.total, self.done = total, 0
        self.callback = progress if callable(progress) else None
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=progress is not True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def advance(self, steps: int) -> None:
        """``steps`` more done."""
        self.reach(self.done + steps)

    def reach(self, done: int) -> None:
        """``done`` steps done in all."""
        self.bar.update(done - self.done)  # a disabled bar (no tqdm display asked for) shows nothing
        self.done = done
        if self.callback is not None:
            self.callback(done, self.total)
