"""``benchmarks/bench_stall.py`` runs, and the package's meeting names the stalled rank, the phase and where it was."""

from __future__ import annotations

import pytest

from tests.benchmarks.conftest import BenchmarkRun
from tests.benchmarks.test_benchmarks_run import assert_whole, lines_starting


# the script's default timeout: with 0.5 s, a healthy meeting on a loaded machine was taken for a stall
@pytest.mark.benchmark_run("bench_stall.py", "--timeout", "2", "--meetings", "3", "--only", "StallGuard")
def test_bench_stall_names_the_stalled_rank_and_its_phase(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    (row,) = lines_starting(out, "| StallGuard |")
    assert row.split("|")[4:7] == [" yes ", " yes ", " yes "], row
