"""``benchmarks/bench_real_model_overhead.py`` runs and prints each figure it measures, on two short SmolLM2 steps
(the checkpoint from ``$LOOPS_CALLBACKS_CACHE``, else built in the run's folder: about 30 s). Its figures are not
checked: the docs' come from a full run."""

from __future__ import annotations

import os
import re

import pytest

from tests.benchmarks.conftest import BenchmarkRun
from tests.benchmarks.test_benchmarks_run import assert_whole

pytest.importorskip("gguf", reason="the dev extra installs gguf: pip install -e '.[dev]'")


@pytest.mark.benchmark_run(
    "bench_real_model_overhead.py", "--steps", "2", "--completion", "8",
    "--cache-dir", os.environ.get("LOOPS_CALLBACKS_CACHE") or "cache",
)
def test_bench_real_model_overhead_prints_the_step_the_entropies_the_hook_and_the_average(
    benchmark_run: BenchmarkRun,
) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("CPU: "), out[:300]
    assert re.search(r"^SmolLM2-135M-Instruct GRPO step .* median \d+\.\d\d s over 2 steps", out, re.MULTILINE), out
    assert re.search(r"^trainer entropies \(with_entropy=True\) on a logged step: [+-]\d+\.\d ms", out, re.MULTILINE), out
    assert re.search(r"^monitor hook: logged step \d+\.\d ms \(1 steps\), not logged \d+\.\d us \(1 steps\)$", out,
                     re.MULTILINE), out
    found = re.search(r"= (\d+\.\d+)% of a step; steps with the monitor / without: (\d+\.\d+)$", out, re.MULTILINE)
    assert found and float(found.group(2)) > 1.0, out
