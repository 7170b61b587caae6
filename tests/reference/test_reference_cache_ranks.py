"""A reference-logprob cache hit on two CPU ranks (gloo): every rank trains on the values rank 0 checked.

Rank 0 checks the file whole; each other rank reads it itself and must find exactly the bytes
rank 0 checked (their sha256). Here a value byte of the file is flipped in place between rank 0's
check and rank 1's read, keeping the checksum in its metadata: rank 1 must not use what it read,
and gets rank 0's values instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

import loops_callbacks.reference.across_ranks as across_ranks
from loops_callbacks.reference.across_ranks import score_across_ranks
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.types import ModelInput
from tests.helpers import free_port, start_two_ranks

TOKENS = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [3, 1, 4, 1, 5]]


class Constant:
    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        return [None] + [-0.5] * (prompt.length - 1)


def _score(directory: str) -> tuple[np.ndarray, str]:
    config = ReferenceConfig(cache_dir=directory, reference_fingerprint="constant", progress=False)
    values, report = score_across_ranks(TOKENS, Constant(), config)
    return values, report.source


def _flip_a_value_in_place_first(reader: Any) -> Any:
    """``reader`` (the function a rank other than 0 reads the file with), after flipping a value byte in place."""

    def flipped(path: Any, *args: Any, **kwargs: Any) -> Any:
        with open(path, "r+b") as file:  # the same file, its trailing checksum kept
            file.seek(-40, os.SEEK_END)
            byte = file.read(1)
            file.seek(-40, os.SEEK_END)
            file.write(bytes([byte[0] ^ 0x55]))
        return reader(path, *args, **kwargs)

    return flipped


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        base = os.path.join(out_dir, "cache")
        results["first"] = _score(base)
        torch.distributed.barrier()
        if rank == 1:
            across_ranks.read_cache = _flip_a_value_in_place_first(across_ranks.read_cache)
        results["second"] = _score(base)
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()


def test_a_rank_that_reads_other_bytes_than_rank_0_checked_trains_on_rank_0s_values(tmp_path: Path) -> None:
    start_two_ranks(_worker, (free_port(), str(tmp_path)), join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    expected = [-0.5 if k < len(ids) - 1 else 0.0 for ids in TOKENS for k in range(len(ids))]  # (shifted: targets)
    for rank, result in enumerate(results):
        assert result["first"][1] == "scored" and result["first"][0].tolist() == expected
        values, source = result["second"]
        assert source == "cache", rank
        assert values.tolist() == expected, f"rank {rank} trains on values rank 0 did not check"
