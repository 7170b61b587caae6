"""``benchmarks/bench_stall.py`` runs, and the package's meeting names the stalled rank, the phase and where it was."""

from __future__ import annotations

from tests.benchmarks.test_benchmarks_run import lines_starting, run_benchmark


def test_bench_stall_names_the_stalled_rank_and_its_phase(tmp_path):
    out = run_benchmark(tmp_path, "bench_stall.py", "--timeout", "0.5", "--meetings", "3", "--only", "StallGuard")
    (row,) = lines_starting(out, "| StallGuard |")
    assert row.split("|")[4:7] == [" yes ", " yes ", " yes "], row
