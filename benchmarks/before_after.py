"""Benchmarks of two versions of the package, side by side in one run: a base commit, and this checkout.

The base commit's files are exported (``git archive``) to a temporary folder; then each benchmark
runs in the base tree and in this one, alternately (``--rounds`` times), each in a subprocess with
its tree first on ``PYTHONPATH``, one torch thread and W&B offline, in a temporary working
folder. It prints, per benchmark, each run's lines that hold a figure, labelled with the version,
so that the figures read side by side.
The machine is the same and the load is shared: the versions differ by the code alone.

    python benchmarks/before_after.py [--base 90951aa] [--only bench_corrections.py ...] [--rounds 1]

``--base`` defaults to the last commit before the redesign merge.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCHMARKS: dict[str, list[str]] = {
    "bench_corrections.py": [],
    "bench_rl_metrics.py": [],
    "bench_callback.py": [],
    "bench_memory.py": [],
    "bench_token_logprobs.py": [],
    "bench_reference_cache.py": [],
    "bench_rank_checks.py": [],
    "bench_tokenization_memory.py": [],
    "bench_distributed.py": [],
    "bench_diagnosis.py": [],
    "bench_demo.py": ["--configs", "rl_tiny", "dpo_tiny", "--skip-startup"],
}
"""Each benchmark and its arguments: the defaults, except the demos (no start-up timings, two configs)."""

QUICK: dict[str, list[str]] = {"bench_corrections.py": ["--quick"]}
"""The smoke test's: one benchmark that takes seconds."""


def export(commit: str, into: Path) -> Path:
    """The files of ``commit`` of this checkout, under ``into`` (nothing is written into the checkout)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True,
                             check=True).stdout
    into.mkdir(parents=True)
    archive_path = into.with_suffix(".tar")
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(into, filter="data")
    return into


def run(tree: Path, script: str, args: list[str], workdir: Path) -> tuple[float, str]:
    """Seconds and output of ``tree/benchmarks/script args`` (stderr's tail when it fails)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "TMPDIR": str(workdir)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=workdir, env=env,
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return seconds, f"FAILED with exit status {done.returncode}:\n{done.stderr[-1500:]}"
    return seconds, done.stdout


def figures(output: str) -> list[str]:
    """The lines of ``output`` that hold figures: every line with a digit (tables, ``name: value`` lines, rows)."""
    return [line for line in output.splitlines() if any(ch.isdigit() for ch in line)]


def main() -> None:
    from benchmarks.machine import cpu_name

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="90951aa", help="the commit to compare with (default: before the redesign)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="these benchmarks only")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each version, alternating")
    parser.add_argument("--quick", action="store_true", help="one short benchmark, reduced sizes (the smoke test)")
    args = parser.parse_args()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    selected = QUICK if args.quick else {name: BENCHMARKS[name] for name in args.only or BENCHMARKS}
    print(f"CPU: {cpu_name()}; before = {args.base}, after = this checkout (HEAD {head}, with its uncommitted changes)")
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"before": export(args.base, Path(scratch) / "before"), "after": ROOT}
        for script, script_args in selected.items():
            print(f"\n## {script} {' '.join(script_args)}".rstrip())
            for round_index in range(args.rounds):
                for version, tree in trees.items():
                    workdir = Path(scratch) / f"{script}-{version}-{round_index}"
                    workdir.mkdir()
                    seconds, output = run(tree, script, script_args, workdir)
                    print(f"\n{version} (round {round_index + 1}, {seconds:.0f} s):")
                    print("\n".join(figures(output) if not output.startswith("FAILED") else [output]))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
