"""One process group for both pipelines: the monitor's reduction and reference scoring use ``ProcessGroup``.

``ProcessGroup()`` is this process's view of the default ``torch.distributed`` group: ``rank``,
``world_size``, ``device`` (where collectives' tensors travel: the current CUDA device on an NCCL
group, else the CPU) and the collectives, which are plain returns in a single process. The
monitor reduces its statistics with two tensor collectives (``all_gather``, ``all_reduce_sum``);
reference scoring moves values as tensors (``gather_blocks``, ``broadcast_tensor``) and only small
metadata (fingerprints, error messages, a cache status) as pickled objects. ``ProcessGroup.of``
gives a Lightning strategy's group: ``torch.distributed``'s when the strategy runs on it, else one
whose two tensor collectives are the strategy's own.

``StallGuard`` makes the ranks meet, through the process group's key-value store, before each
collective phase: a rank that stalls (or died) is then named on every other rank within a timeout,
instead of leaving them in a collective for the backend's own timeout (gloo's is 30 minutes).

Examples:
    >>> group = ProcessGroup()
    >>> group.rank, group.world_size, group.max_int(3), group.any_true(False)
    (0, 1, 3, False)
    >>> group.gather_blocks(torch.tensor([1.0, 2.0]), [0, 2]).tolist(), group.all_gather(torch.ones(2)).shape
    ([1.0, 2.0], torch.Size([1, 2]))
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessGroup", "RankStalledError", "StallGuard", "fail_together", "raise_together"]


class ProcessGroup:
    """This process's rank and the collectives of the default ``torch.distributed`` group (``local=True``: this
    process alone, for work on weights that are not distributed)."""

    def __init__(self, *, local: bool = False) -> None:
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device("cpu")
        if self.distributed and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def of(strategy: Any) -> Any:
        """The process group of a Lightning strategy (``trainer.strategy``; a process group is returned as it is):
        ``torch.distributed``'s when the strategy runs on it (Lightning's ``reduce`` runs a barrier before each
        all-reduce: one more collective, and a host synchronization under NCCL), else the strategy's own
        ``all_gather`` and ``reduce`` (its two tensor collectives only)."""
        if hasattr(strategy, "all_reduce_sum"):
            return strategy
        group = ProcessGroup()
        return group if group.distributed and group.world_size == strategy.world_size else _StrategyGroup(strategy)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (one shape everywhere) stacked in rank order: ``[world_size, ...]``, where
        ``tensor`` is."""
        if self.world_size == 1:
            return tensor[None]
        sent = tensor.to(self.device).contiguous()
        gathered = sent.new_empty((self.world_size, *sent.shape))
        if dist.get_backend() == "nccl":
            dist.all_gather_into_tensor(gathered, sent)
        else:  # gloo has no all_gather_into_tensor; it fills the rows of ``gathered`` in place
            dist.all_gather(list(gathered.unbind(0)), sent)
        return gathered.to(tensor.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's ``tensor``, where ``tensor`` is; may reuse its storage."""
        if self.world_size == 1:
            return tensor
        buffer = tensor.to(self.device).contiguous()
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        return buffer.to(tensor.device)

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


class _StrategyGroup(ProcessGroup):
    """A Lightning strategy not on ``torch.distributed``: its ``all_gather`` and ``reduce`` (the monitor's two tensor
    collectives; nothing else runs across its ranks)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(local=True)
        self.strategy, self.rank, self.world_size = strategy, int(strategy.global_rank), int(strategy.world_size)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.all_gather(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.reduce(tensor, reduce_op="sum")


def raise_together(group: ProcessGroup, failure: BaseException | None, what: str) -> None:
    """Raise on every rank when ``what`` failed on any (collective: every rank must call it).

    The rank that failed raises its own exception; the others a ``ValueError`` / ``TypeError``
    (when that is what it was) or a ``RuntimeError``, naming each failed rank and its message.

    Examples:
        >>> raise_together(ProcessGroup(), None, "tokenizing")  # nothing failed: returns
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
        >>> with fail_together(StallGuard(ProcessGroup(), timeout=None), "tokenizing", then="gathering the pairs"):
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
        >>> guard = StallGuard(ProcessGroup(), timeout=5.0)
        >>> guard.note("scoring block 1 of 1")
        >>> guard.arrive("gathering values")  # a single process: nothing to wait for
    """

    _PREFIX = "loops_callbacks/stall_guard"
    _ABORT = f"{_PREFIX}/aborted"

    def __init__(self, group: ProcessGroup, timeout: float | None) -> None:
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
