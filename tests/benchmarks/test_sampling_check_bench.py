"""The sampling-check benchmark runs on tiny settings and prints its table (not its figures)."""

from __future__ import annotations

import pytest

from tests.benchmarks.conftest import BenchmarkRun

pytest.importorskip("transformers")


@pytest.mark.benchmark_run("bench_sampling_check.py", "--set", "threshold", "--healthy-steps", "1", "--fault-steps", "1",
                           "--sequences", "4", "--tokens", "8")
def test_bench_sampling_check_prints_a_row_per_engine_sampler_and_setting(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    rows = [line for line in out.splitlines() if line.startswith("| hf |")]
    assert len(rows) == 12 and all(row.count("|") == 10 for row in rows), out
