"""The process-group operations reference scoring needs, as tensors, over ``torch.distributed`` when it runs.

``Group()`` is this process's view: ``rank``, ``world_size`` and the collectives, which are plain
returns in a single process. Values move as tensors (``gather_blocks``, ``broadcast_tensor``);
only small metadata (fingerprints, error messages, a cache status) moves as pickled objects. On
an NCCL group the tensors travel through the current CUDA device.

Example:
    >>> import torch
    >>> group = Group()
    >>> group.rank, group.world_size, group.max_int(3), group.any_true(False)
    (0, 1, 3, False)
    >>> group.gather_blocks(torch.tensor([1.0, 2.0]), [0, 2]).tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from loops_callbacks import run_warnings

__all__ = ["Group"]


class Group:
    """This process's rank and the collectives of the default ``torch.distributed`` group."""

    def __init__(self, *, local: bool = False) -> None:
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = torch.device("cpu")
        if self.distributed and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def local(cls) -> Group:
        """This process alone (for work on weights that are not distributed)."""
        return cls(local=True)

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
        if tensor.device == self.device:
            dist.broadcast(tensor, src=src)
            return tensor
        moved = tensor.to(self.device)
        dist.broadcast(moved, src=src)
        tensor.copy_(moved)
        return tensor

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
            if block.numel() == 0:
                continue
            if rank == self.rank:
                block.copy_(local)
            dist.broadcast(block, src=rank)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def warn_once(self, message: str, category: type[Warning] = UserWarning) -> None:
        """A warning on this group's rank 0 only (``loops_callbacks.run_warnings``)."""
        if self.rank == 0:
            run_warnings.warn(message, category, stacklevel=4)
