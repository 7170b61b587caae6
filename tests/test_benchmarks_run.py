"""The benchmarks that read the monitor's internals still run (a refactor once broke bench_diagnosis silently).

A smoke run with tiny settings in a subprocess: it checks that the script works and prints its
table, not its figures (the README's come from full runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_diagnosis_runs_and_prints_its_confusion_table(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_diagnosis.py"), "--base-steps", "2", "--steps", "2",
         "--skip", "0", "--seeds", "0"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| seeded cause | impossible_inputs | none |" in done.stdout, done.stdout[-3000:]
    assert "Per fault setting (named cause: steps):" in done.stdout
