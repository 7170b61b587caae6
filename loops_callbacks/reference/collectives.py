"""The process-group operations reference scoring needs, as tensors, over ``torch.distributed`` when it runs.

``Group()`` is this process's view: ``rank``, ``world_size`` and the collectives, which are plain
returns in a single process. Values move as tensors (``gather_blocks``, ``broadcast_tensor``);
only small metadata (fingerprints, error messages, a cache status) moves as pickled objects. On
an NCCL group the tensors travel through the current CUDA device.

``StallGuard`` makes the ranks meet, through the process group's key-value store, before each
collective phase: a rank that stalls (or died) is then named on every other rank within a timeout,
instead of leaving them in a collective for the backend's own timeout (gloo's is 30 minutes).

Examples:
    >>> import torch
    >>> group = Group()
    >>> group.rank, group.world_size, group.max_int(3), group.any_true(False)
    (0, 1, 3, False)
    >>> group.gather_blocks(torch.tensor([1.0, 2.0]), [0, 2]).tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


__all__ = ["Group", "RankStalledError", "StallGuard", "fail_together", "raise_together"]


class Group:
    """This process's rank and the collectives of the default ``torch.distributed`` group (``local=True``: this
    process alone, for work on weights that are not distributed)."""

    def __init__(self, *, local: bool = False) -> None:
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device("cpu")
        if self.distributed and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small metadata only: it is pickled)."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (small metadata only)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def max_int(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def any_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return self.max_int(int(flag)) > 0

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s values, in place in ``tensor`` on every rank (same shape and dtype everywhere)."""
        if self.world_size == 1 or tensor.numel() == 0:
            return tensor
        moved = tensor.to(self.device)  # ``tensor`` itself when it is there
        dist.broadcast(moved, src=src)
        return tensor.copy_(moved) if moved is not tensor else tensor

    def gather_blocks(self, local: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
        """The concatenation of every rank's 1-D block: rank r's ``local`` fills ``[bounds[r], bounds[r + 1])``.

        Every rank receives the whole result; it is written in place, one broadcast per rank, so
        no rank holds more than the result (and its own block).
        """
        if self.world_size == 1:
            return local
        if local.numel() != bounds[self.rank + 1] - bounds[self.rank]:
            raise ValueError(
                f"rank {self.rank} holds {local.numel()} values for its block [{bounds[self.rank]}, "
                f"{bounds[self.rank + 1]})"
            )
        out = torch.empty(bounds[-1], dtype=local.dtype, device=self.device)
        for rank in range(self.world_size):
            block = out[bounds[rank] : bounds[rank + 1]]
            if rank == self.rank:
                block.copy_(local)
            self.broadcast_tensor(block, src=rank)  # on the device already, in place; an empty block is skipped
        return out


def raise_together(group: Group, failure: BaseException | None, what: str) -> None:
    """Raise on every rank when ``what`` failed on any (collective: every rank must call it).

    The rank that failed raises its own exception; the others a ``ValueError`` / ``TypeError``
    (when that is what it was) or a ``RuntimeError``, naming each failed rank and its message.

    Examples:
        >>> raise_together(Group(), None, "tokenizing")  # nothing failed: returns
    """
    if not group.any_true(failure is not None):
        return
    messages = group.all_gather_objects(None if failure is None else (type(failure).__name__, str(failure)))
    if failure is not None:
        raise failure
    failed = [(rank, *message) for rank, message in enumerate(messages) if message is not None]
    kinds = {kind for _, kind, _ in failed}
    known = {"ValueError": ValueError, "TypeError": TypeError}
    category = known.get(kinds.pop(), RuntimeError) if len(kinds) == 1 else RuntimeError
    listed = "; ".join(f"rank {rank}: {kind}: {text}" for rank, kind, text in failed)
    raise category(f"{what} failed on another rank ({listed})")


@contextmanager
def fail_together(guard: StallGuard, what: str, *, then: str) -> Iterator[None]:
    """Run the block on every rank, meet before ``then`` (``guard.arrive``), and fail on all if it failed on any.

    An exception in the block is held until every rank has come (so none is left waiting in the
    next collective), then raised on every rank by ``raise_together`` (what failed, and where).

    Examples:
        >>> with fail_together(StallGuard(Group(), timeout=None), "tokenizing", then="gathering the pairs"):
        ...     pairs = [1, 2]
        >>> pairs
        [1, 2]
    """
    failure: BaseException | None = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 - every rank must reach the next collective, or the others wait
        failure = error
    guard.arrive(then)
    raise_together(guard.group, failure, what)


class RankStalledError(RuntimeError):
    """A rank did not reach a collective step within the timeout (stalled or ended), or another rank gave up waiting."""


class StallGuard:
    """The ranks meet before each collective phase; one that does not come within ``timeout`` seconds is named.

    ``arrive(phase)`` marks this rank ready to enter ``phase`` and waits for every rank (through
    the default process group's store, so it works for any backend). On a timeout the waiting rank
    raises a ``RankStalledError`` naming the phase, the ranks that did not arrive and where each
    was last (``note``), and leaves an abort mark in the store: a late rank raises too, instead of
    entering a collective alone. Without a process group, a store or a ``timeout``, it does nothing.

    Examples:
        >>> guard = StallGuard(Group(), timeout=5.0)
        >>> guard.note("scoring block 1 of 1")
        >>> guard.arrive("gathering values")  # a single process: nothing to wait for
    """

    _PREFIX = "loops_callbacks/stall_guard"
    _ABORT = f"{_PREFIX}/aborted"

    def __init__(self, group: Group, timeout: float | None) -> None:
        self.group = group
        self.rank, self.world_size, self.timeout = group.rank, group.world_size, timeout
        self.store = _default_store() if timeout is not None and group.world_size > 1 else None

    def before_forward(self, index: int, count: int) -> None:
        """Every rank meets before each lock-step forward, so a rank stalled in a sharded forward is named."""
        phase = f"lock-step forward {index + 1} of {count}"
        self.arrive(phase)
        self.note(f"in {phase}")

    def note(self, phase: str) -> None:
        """Record that this rank is now in ``phase`` (named if another rank times out waiting for it)."""
        if self.store is not None:
            with self._store_lost(phase):
                self.store.set(f"{self._PREFIX}/last/{self.rank}", phase)

    def arrive(self, phase: str) -> None:
        """Wait until every rank has arrived at ``phase`` (at most ``timeout`` seconds)."""
        store = self.store
        if store is None or self.timeout is None:
            return
        with self._store_lost(phase):
            self._raise_if_aborted(phase)
            number = store.add(f"{self._PREFIX}/count/{self.rank}", 1)
            keys = [f"{self._PREFIX}/{number}/{rank}" for rank in range(self.world_size)]
            store.set(f"{self._PREFIX}/last/{self.rank}", f"waiting to start {phase}")
            store.set(keys[self.rank], phase)
            deadline = time.monotonic() + self.timeout
            pause = 0.001
            while not store.check(keys):
                self._raise_if_aborted(phase)
                if time.monotonic() > deadline:
                    missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
                    where = "; ".join(f"rank {rank} is still at: {self._last(rank)}" for rank in missing)
                    message = (
                        f"rank(s) {', '.join(map(str, missing))} did not reach {phase!r} within {self.timeout:g} s "
                        f"(a stalled or failed rank; {where}). Raise the timeout (scoring_timeout) if the work is "
                        "just slow"
                    )
                    store.set(self._ABORT, f"rank {self.rank} gave up waiting: {message}")
                    raise RankStalledError(f"rank {self.rank}: {message}")
                time.sleep(pause)
                pause = min(2 * pause, 0.05)

    def _last(self, rank: int) -> str:
        key = f"{self._PREFIX}/last/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "not started"

    def _raise_if_aborted(self, phase: str) -> None:
        if self.store.check([self._ABORT]):
            raise RankStalledError(f"rank {self.rank} stops before {phase!r}: {self.store.get(self._ABORT).decode()}")

    @contextmanager
    def _store_lost(self, phase: str) -> Iterator[None]:
        """A store that fails (its host, rank 0, has ended) is a ``RankStalledError`` naming the phase."""
        try:
            yield
        except RankStalledError:
            raise
        except (RuntimeError, ConnectionError) as error:
            raise RankStalledError(
                f"rank {self.rank} lost the process group's store before {phase!r} (its host, rank 0, has "
                f"probably ended): {error}"
            ) from error


def _default_store() -> Any:
    """The default process group's key-value store, or ``None`` when it cannot be reached."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - a private function, absent or failing: no guard, plain collectives
        return None
