"""A rank that stalls while scoring the reference is named on every other rank within the timeout, with no hang.

Two gloo ranks as separate processes (``main``, forked by ``tests.helpers.start_python``): one sleeps in its
scoring forward far longer than ``scoring_timeout``. The other must stop within the timeout with a
``RankStalledError`` naming the step it waited at and the rank that did not come (and where that
rank was); the late rank, when it wakes, must stop too instead of entering a collective alone.
The three cases' pairs start at once (``stalled_runs``): each mostly sleeps through its stall.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import ForkedPython, free_port, start_python

TIMEOUT_S = 2.0
STALL_S = 6.0


class SleepyClient:
    """-0.5 everywhere, after ``sleep`` seconds on the first prompt."""

    vocab_size = 16

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        time.sleep(self.sleep)
        self.sleep = 0.0
        return [None] + [-0.5] * (prompt.length - 1)


def sleepy_policy(sleep: float) -> Any:
    """The policy itself as the reference (lock-step forwards), sleeping ``sleep`` seconds in its first forward."""
    import torch

    from loops_callbacks.reference.policy import PolicyReference

    class SleepyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
            self.sleep = sleep

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            time.sleep(self.sleep)
            self.sleep = 0.0
            return self.out(self.embed(input_ids))

    torch.manual_seed(0)
    return PolicyReference(SleepyLM(), device="cpu", max_tokens_per_batch=3, output_head=False)


def main() -> None:
    """One rank: score four datums, the stalled rank sleeping in its forward; print how it ended."""
    import torch

    from loops_callbacks.reference.across_ranks import score_across_ranks
    from loops_callbacks.reference.config import ReferenceConfig

    rank, stalled = int(os.environ["RANK"]), int(os.environ["STALLED_RANK"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    sequences = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7]]
    sleep = STALL_S if rank == stalled else 0.0
    client = sleepy_policy(sleep) if os.environ.get("REFERENCE") == "policy" else SleepyClient(sleep)
    start = time.monotonic()
    try:
        score_across_ranks(sequences, client, ReferenceConfig(progress=False, scoring_timeout=TIMEOUT_S))
    except Exception as error:  # noqa: BLE001 - the test reads it
        print(f"after {time.monotonic() - start:.1f} s: {type(error).__name__}: {error}", flush=True)
        os._exit(3)  # no clean-up of a process group whose peer is gone
    print("finished", flush=True)
    os._exit(0)


def start_two_ranks(stalled: int, reference: str) -> list[ForkedPython]:
    """Both ranks as processes (``main``), rank ``stalled`` sleeping in its scoring."""
    port = free_port()
    return [start_python("-c", "from tests.reference.test_scoring_stall import main; main()", stderr_to_stdout=True,
                         env=dict(os.environ, RANK=str(rank), STALLED_RANK=str(stalled), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1", REFERENCE=reference))
            for rank in (0, 1)]


CASES = {"rank1_stalls": (1, "client"), "rank0_stalls": (0, "client"), "policy_rank1_stalls": (1, "policy")}


@pytest.fixture(scope="module")
def stalled_runs() -> Iterator[dict[str, list[subprocess.CompletedProcess[str]]]]:
    """Every case's two ranks, all started at once (each mostly waits out its stall): how each ended."""
    started = {case: start_two_ranks(*args) for case, args in CASES.items()}
    try:
        yield {case: [rank.wait(timeout=120) for rank in ranks] for case, ranks in started.items()}
    finally:
        for rank in (rank for ranks in started.values() for rank in ranks):
            rank.kill()


@pytest.mark.parametrize("stalled", [1, 0], ids=["rank1_stalls", "rank0_stalls"])
def test_a_stalled_rank_is_named_within_the_timeout(stalled: int, stalled_runs: dict[str, Any]) -> None:
    ranks = stalled_runs[f"rank{stalled}_stalls"]
    waiting = 1 - stalled
    waited = ranks[waiting].stdout.strip().splitlines()[-1]
    assert ranks[waiting].returncode == 3, ranks[waiting].stdout
    assert "RankStalledError" in waited, waited
    assert f"rank(s) {stalled} did not reach 'gathering the scored values' within {TIMEOUT_S:g} s" in waited, waited
    assert f"rank {stalled} is still at: scoring its block" in waited, waited
    seconds = float(waited.split()[1])
    assert TIMEOUT_S <= seconds < STALL_S, waited  # named within the timeout, not after the stall ended
    late = ranks[stalled].stdout.strip().splitlines()[-1]
    assert ranks[stalled].returncode == 3, ranks[stalled].stdout
    assert "RankStalledError" in late, late
    if stalled == 0:  # the store (on rank 0) is still up: the late rank reads why rank 1 gave up
        assert "rank 0 stops before 'gathering the scored values': rank 1 gave up waiting" in late, late
    else:  # rank 0, which held the store, has ended
        assert "rank 1 lost the process group's store" in late, late


def test_a_rank_stalled_in_a_lock_step_forward_is_named_at_the_next_forward(stalled_runs: dict[str, Any]) -> None:
    """The policy as the reference: its forwards may be collectives (FSDP), so the ranks meet before each."""
    ranks = stalled_runs["policy_rank1_stalls"]
    waited = ranks[0].stdout.strip().splitlines()[-1]
    assert ranks[0].returncode == 3 and "RankStalledError" in waited, ranks[0].stdout
    assert f"rank(s) 1 did not reach 'lock-step forward 2 of 2' within {TIMEOUT_S:g} s" in waited, waited
    assert "rank 1 is still at: in lock-step forward 1 of 2" in waited, waited
    assert TIMEOUT_S <= float(waited.split()[1]) < STALL_S, waited
    assert ranks[1].returncode == 3, ranks[1].stdout


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (float("nan"), ValueError), ("60", TypeError)])
def test_the_timeout_is_checked(value: Any, error: type[Exception]) -> None:
    from loops_callbacks.data import DPODataModule, Scoring

    with pytest.raises(error, match=f"scoring_timeout must be a number of seconds > 0, or None for no limit, got {value!r}"):
        DPODataModule(data=[], scoring=Scoring(scoring_timeout=value))
