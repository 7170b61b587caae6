"""Wall and CPU time of the shipped demos, run with the README's command, start-up included.

Each config runs as ``OMP_NUM_THREADS=1 loops-callbacks fit --config configs/<name>.yaml`` in a
fresh temporary directory (so ``runs/`` and the DPO reference cache start empty, as on a first
run), with one callback added that only notes the time of the first and last training step.
Printed per run: wall seconds, CPU seconds (user + sys of the command and the child processes
it waited for), seconds to the first training step, seconds per step after it, and what the run
logged (reward and ``kl_sample_train_k3`` for RL, held-out DPO accuracy, the guard rail's stop).
Before the runs: the CPU (``lscpu``), whether torch has native bf16 kernels on it (a bf16/float32
matmul time ratio), ``loops-callbacks --help``, ``import loops_callbacks.cli`` and the heaviest
imports under it (``python -X importtime``).

``--no-native-bf16`` runs everything with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``:
torch then uses its AVX2 kernels, in which bf16 is emulated, as on a CPU without native bf16
(the printed matmul ratio shows whether it took effect). Wall times on a shared machine are
noisy; CPU times much less so; ``--repeats`` gives several runs of each.

Setup and use (from the repository root)::

    pip install torch==2.13.0 -e ".[dev]"
    python benchmarks/bench_demo.py                        # the three demos, once each
    python benchmarks/bench_demo.py --no-native-bf16 --repeats 3
    python benchmarks/bench_demo.py --configs rl_tiny --keep runs_bench
    python benchmarks/bench_demo.py --configs dpo_tiny --max-steps 2 --skip-startup   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from loops_callbacks.cli.summary import EXIT_GUARD_RAIL_STOPPED, EXIT_OK
from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("rl_tiny", "rl_stale_sampler", "dpo_tiny")
NO_NATIVE_BF16 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_CLOCK_ENV = "BENCH_DEMO_CLOCK_FILE"
_K3 = "optim/train-sample-div/kl_sample_train_k3"

_BF16_PROBE = """
import time, torch
torch.set_num_threads(1)
x = torch.randn(256, 256)
def per_matmul(a):
    for _ in range(3): a @ a
    start = time.perf_counter()
    for _ in range(20): a @ a
    return (time.perf_counter() - start) / 20
print(torch.__version__, torch.backends.cpu.get_cpu_capability(), per_matmul(x.bfloat16()) / per_matmul(x))
"""


class StepClock(Callback):
    """Appends the wall-clock time of the first and last training step to ``$BENCH_DEMO_CLOCK_FILE``.

    Added to the demo command with ``--trainer.callbacks+=bench_demo.StepClock``; it does nothing else.
    """

    def __init__(self) -> None:
        self.steps = 0

    def _note(self, event: str) -> None:
        with open(os.environ[_CLOCK_ENV], "a") as out:
            out.write(json.dumps({"event": event, "time": time.time(), "steps": self.steps}) + "\n")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.steps == 0:
            self._note("first_step")
        self.steps += 1

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._note("train_end")


def _timed(
    command: list[str], env: dict[str, str], cwd: str | Path, ok: tuple[int, ...] = (EXIT_OK,)
) -> tuple[float, float, str, int]:
    """(wall s, CPU s of the command and its waited-for children, stdout + stderr, exit status in ``ok``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = done.stdout + done.stderr
    if done.returncode not in ok:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{output[-3000:]}")
    return wall, cpu, output, done.returncode


_HEAVY = (
    "torch", "torch._dynamo", "torchmetrics", "transformers", "lightning", "wandb", "tensorboard",
    "tensorboardX", "numpy", "jsonargparse", "sympy", "pandas", "scipy", "matplotlib",
)


def _import_breakdown(env: dict[str, str]) -> list[tuple[float, str, str, str]]:
    """Where ``import loops_callbacks.cli`` spends its time, from ``python -X importtime``.

    Rows (cumulative seconds, module, its importer, the first of our modules above it) for every
    import one of our modules makes directly (>= 0.05 s), every import of one package by another
    (>= 0.2 s) and well-known heavy packages, where first imported (an import of a module already
    imported costs nothing).
    """
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import loops_callbacks.cli"],
        env=env, capture_output=True, text=True, check=True,
    )
    rows: list[tuple[float, int, str]] = []
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if match:
            rows.append((int(match.group(1)) / 1e6, (len(match.group(2)) - 1) // 2, match.group(3)))
    # importtime prints a module after its imports: a row's importer is the next row less indented.
    parents: list[int | None] = []
    for index, (_, depth, _) in enumerate(rows):
        parents.append(next((j for j in range(index + 1, len(rows)) if rows[j][1] < depth), None))
    found = []
    for index, (seconds, _, name) in enumerate(rows):
        chain, parent = [], parents[index]
        while parent is not None:
            chain.append(rows[parent][2])
            parent = parents[parent]
        ours = next((module for module in chain if module.startswith("loops_callbacks")), "-")
        importer = chain[0] if chain else "-"
        direct = importer.startswith("loops_callbacks") and not name.startswith("loops_callbacks")
        crossing = importer != "-" and importer.split(".")[0] != name.split(".")[0]  # one package importing another
        if (direct and seconds >= 0.05) or (crossing and seconds >= 0.2) or name in _HEAVY:
            found.append((seconds, name, importer, ours))
    return sorted(found, reverse=True)


def _read_csv(run_dir: Path) -> list[dict[str, str]]:
    paths = sorted(run_dir.glob("runs/*/csv/version_*/metrics.csv"))
    if not paths:
        return []
    with open(paths[-1], newline="") as handle:
        return list(csv.DictReader(handle))


def _series(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row[key])) for row in rows if row.get(key)]


def _figures(rows: list[dict[str, str]], output: str, status: int) -> str:
    """What the run logged, in a line."""
    parts = []
    reward, k3 = _series(rows, "train/reward"), _series(rows, _K3)
    accuracy = _series(rows, "val/dpo_accuracy")
    if reward:
        (s0, r0), (s1, r1) = reward[0], reward[-1]
        parts.append(f"reward {r0:.2f} (step {s0}) -> {r1:.2f} (step {s1})")
    if k3:
        values = [value for _, value in k3]
        parts.append(f"k3 {min(values):.1e}..{max(values):.1e} (last {values[-1]:.1e})")
    if accuracy:
        (s0, a0), (s1, a1) = accuracy[0], accuracy[-1]
        parts.append(f"val/dpo_accuracy {a0:.2f} (step {s0}) -> {a1:.2f} (step {s1})")
    if status == EXIT_GUARD_RAIL_STOPPED:
        stop = re.search(r"(\S+ = \S+ exceeded max_kl = \S+ at step \d+)", output)
        parts.append(f"stopped by the guard rail (exit status {status}): {stop.group(1) if stop else '?'}")
    return "; ".join(parts) or "(nothing logged)"


def run_demo(
    cli: str, config: str, env: dict[str, str], keep: Path | None, clock: bool, max_steps: int | None = None
) -> dict[str, Any]:
    """One run of ``loops-callbacks fit --config configs/<config>.yaml`` in a fresh directory
    (``max_steps``: with ``--trainer.max_steps``)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_demo_{config}_"))
    clock_file = run_dir / "clock.jsonl"
    command = [cli, "fit", "--config", str(ROOT / "configs" / f"{config}.yaml")]
    if max_steps is not None:
        command += ["--trainer.max_steps", str(max_steps)]
    env = dict(env)
    if clock:
        command.append("--trainer.callbacks+=bench_demo.StepClock")
        env[_CLOCK_ENV] = str(clock_file)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH")]))
    launched = time.time()
    wall, cpu, output, status = _timed(command, env, run_dir, ok=(EXIT_OK, EXIT_GUARD_RAIL_STOPPED))
    result: dict[str, Any] = {"config": config, "wall_s": wall, "cpu_s": cpu}
    if clock and clock_file.exists():
        events = {e["event"]: e for e in map(json.loads, clock_file.read_text().splitlines())}
        if "first_step" in events:
            result["to_first_step_s"] = events["first_step"]["time"] - launched
        if "first_step" in events and "train_end" in events and events["train_end"]["steps"] > 1:
            steps = events["train_end"]["steps"]
            result["steps"] = steps
            result["s_per_step"] = (events["train_end"]["time"] - events["first_step"]["time"]) / steps
    result["figures"] = _figures(_read_csv(run_dir), output, status)
    if keep is not None:
        target = keep / f"{config}_{int(launched)}"
        shutil.copytree(run_dir, target)
        result["kept"] = str(target)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each config (default 1)")
    parser.add_argument("--no-native-bf16", action="store_true", help=f"run with {NO_NATIVE_BF16}")
    parser.add_argument("--no-clock", action="store_true", help="run the command exactly, without StepClock")
    parser.add_argument("--skip-startup", action="store_true", help="skip --help, import and importtime")
    parser.add_argument("--keep", type=Path, help="copy each run's directory (logs) under this folder")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--max-steps", type=int, help="end each run after this many steps (a smoke run)")
    args = parser.parse_args()
    cli = shutil.which("loops-callbacks", path=str(Path(sys.executable).parent)) or shutil.which("loops-callbacks")
    if cli is None:
        raise SystemExit('no loops-callbacks command: pip install torch==2.13.0 -e ".[dev]"')

    # OMP_NUM_THREADS=1 as in the README; W&B offline, as the CLI chooses without a W&B login.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    if args.no_native_bf16:
        env.update(NO_NATIVE_BF16)
    probe = subprocess.run([sys.executable, "-c", _BF16_PROBE], env=env, capture_output=True, text=True, check=True)
    torch_version, capability, ratio = probe.stdout.split()
    print(f"CPU: {cpu_name()}")
    print(
        f"torch {torch_version}, kernels: {capability}, bf16/float32 matmul time: {float(ratio):.1f}x "
        f"({'no native bf16' if float(ratio) > 3 else 'native bf16'}); OMP_NUM_THREADS=1"
        + (f"; {' '.join(f'{k}={v}' for k, v in NO_NATIVE_BF16.items())}" if args.no_native_bf16 else "")
    )
    results: dict[str, Any] = {"cpu": cpu_name(), "capability": capability, "bf16_ratio": float(ratio), "runs": []}

    if not args.skip_startup:
        for label, command in (
            ("loops-callbacks --help", [cli, "--help"]),
            ("import loops_callbacks.cli", [sys.executable, "-c", "import loops_callbacks.cli"]),
        ):
            times = [_timed(command, env, ROOT)[:2] for _ in range(max(args.repeats, 2))]
            wall, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
            print(f"{label:28s} wall {wall:5.2f} s  CPU {cpu:5.2f} s  (median of {len(times)})")
            results[label] = {"wall_s": wall, "cpu_s": cpu}
        print("where `import loops_callbacks.cli` spends its time (python -X importtime, cumulative s):")
        breakdown = _import_breakdown(env)
        for seconds, module, importer, ours in breakdown:
            print(f"  {seconds:5.2f}  {module:22s} imported by {importer:40s} (under {ours})")
        results["imports"] = breakdown

    print("\n| config | wall s | CPU s | to first step s | s/step | steps | logged |\n|---|---|---|---|---|---|---|")
    for config in args.configs:
        for _ in range(args.repeats):
            result = run_demo(cli, config, env, args.keep, clock=not args.no_clock, max_steps=args.max_steps)
            results["runs"].append(result)
            print(
                f"| {config} | {result['wall_s']:.1f} | {result['cpu_s']:.1f} | "
                f"{result.get('to_first_step_s', float('nan')):.1f} | {result.get('s_per_step', float('nan')):.3f} | "
                f"{result.get('steps', '?')} | {result['figures']} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
