"""``benchmarks/before_after.py`` runs a benchmark in a base commit's tree and in this one, and prints both."""

from __future__ import annotations

from tests.benchmarks.test_benchmarks_run import lines_starting, run_benchmark


def test_before_after_prints_each_versions_figures(tmp_path):
    out = run_benchmark(tmp_path, "before_after.py", "--quick", "--base", "HEAD")
    assert "FAILED" not in out, out[-3000:]
    assert len(lines_starting(out, "before (round 1")) == len(lines_starting(out, "after (round 1")) == 1, out
    assert len(lines_starting(out, "| shadow: geo |")) == 2, out
