"""bench_corrections still runs against the monitor's statistics (a smoke run: its table, not its figures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_corrections_runs_and_prints_a_row_per_correction(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_corrections.py"), "--datums", "4", "--length", "32",
         "--repeats", "1"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("CPU: "), out[:300]
    assert "| DivergenceStats.from_batch (monitor, logged step) |" in out
    for label in ("shadow: sequence_mask |", "shadow: geo |", "shadow: off_policy_mask:0.01 |",
                  "shadow: sequence_mask + geo + token_tis |"):
        assert label in out, out
