"""``benchmarks/before_after.py`` runs a benchmark in a base commit's tree and in this one, and prints both."""

from __future__ import annotations

import pytest

from tests.benchmarks.conftest import BenchmarkRun
from tests.benchmarks.test_benchmarks_run import assert_whole, lines_starting


@pytest.mark.benchmark_run("before_after.py", "--quick", "--base", "HEAD")
def test_before_after_prints_each_versions_figures(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert "FAILED" not in out, out[-3000:]
    assert len(lines_starting(out, "before (round 1")) == len(lines_starting(out, "after (round 1")) == 1, out
    assert len(lines_starting(out, "| shadow: geo |")) == 2, out
