"""The sampling-check benchmark runs on tiny settings and prints its table (not its figures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_sampling_check_prints_a_row_per_engine_sampler_and_setting(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sampling_check.py"), "--set", "threshold",
         "--healthy-steps", "1", "--fault-steps", "1", "--sequences", "4", "--tokens", "8"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| hf |")]
    assert len(rows) == 12 and all(row.count("|") == 10 for row in rows), done.stdout
