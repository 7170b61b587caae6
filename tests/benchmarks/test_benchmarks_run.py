"""The benchmarks that read the monitor's internals still run (a refactor once broke bench_diagnosis silently).

A smoke run with tiny settings in a subprocess: it checks that the script works and prints its
table, not its figures (the README's come from full runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_diagnosis_runs_and_prints_its_confusion_table(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_diagnosis.py"), "--base-steps", "2", "--steps", "2",
         "--skip", "0", "--seeds", "0"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| seeded cause | impossible_inputs | none |" in done.stdout, done.stdout[-3000:]
    assert "Per fault setting (named cause: steps):" in done.stdout


def test_bench_diagnosis_tables_prints_the_tuning_and_every_held_out_table(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_diagnosis.py"), "--tables", "--quick",
         "--cache-dir", str(cache)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("CPU: "), out[:300]
    tuning, seen, seen_after, held_out = out.split("\nHeld-out set ")
    assert seen.startswith("1, seen (rules were designed looking at it)"), seen[:300]
    assert seen_after.startswith("2, seen (held out for one rule change, then looked at)"), seen_after[:300]
    assert held_out.startswith("3, held out (never tuned on)"), held_out[:300]
    for table, cause in ((tuning, "seeded cause"), (seen, "true cause"), (seen_after, "true cause"),
                         (held_out, "true cause")):
        assert f"| {cause} | impossible_inputs | none |" in table, table[-3000:]
        assert "Precision when a cause is named (right / named):" in table
    for heldout in (seen, seen_after, held_out):
        for row in ("| temperature |", "| stale |", "| stale (prefix cache) |", "| shift |", "| template |",
                    "| dropout |"):
            assert row in heldout, heldout[-3000:]
    assert "peaked: stale prefix KV cache (4 steps):" in seen and "flat: completion-only, left-aligned:" in seen
    assert "peaked: stale prefix KV cache (2 steps):" in seen_after
    assert "flat: template: a token inserted after BOS:" in seen_after
    assert "peaked: stale prefix KV cache (3 steps):" in held_out and "flat: offset +6:" in held_out
    assert [p.suffix for p in cache.iterdir()] == [".pt"] * 6  # one file per set and variant, in the given folder


def test_bench_correction_demo_runs_and_prints_the_comparison(tmp_path: Path) -> None:
    curves = tmp_path / "curves.csv"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_correction_demo.py"), "--seeds", "0", "--steps", "4",
         "--eval-every", "2", "--lags", "16", "--corrections", "token_truncate:2.0", "--out", str(curves)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| sampler, loss | policy reward at step 2 | step 4 |" in out, out[-3000:]
    for variant in ("synced every step", "synced every 16 steps, Loops' ratio", "synced every 16 steps, token_truncate"):
        assert f"| {variant}" in out, out[-3000:]
    assert curves.read_text().startswith("variant,seed,step,sampled_reward,policy_reward,k3")


def test_gpu_checks_without_cuda_say_so_in_one_line_and_write_nothing(tmp_path: Path) -> None:
    before = sorted(p.name for p in ROOT.iterdir())
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_checks.sh"), str(tmp_path / "out")], cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and "no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in ROOT.iterdir()) == before
