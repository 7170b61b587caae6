"""Every benchmark still runs and prints whole output (a refactor once broke bench_diagnosis silently).

Each script runs in a subprocess (``sys.executable``, one torch thread, W&B offline, temporary
files in its run's folder) on settings that take seconds, started ahead of its test (``conftest``);
a test checks that it works and that what it prints is whole (its tables' rows as wide as their
headers, no number nan or inf), not its figures: the README's come from full runs. ``heldout_faults.py`` is a module, tested by
``test_heldout_faults.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.conftest import BenchmarkRun

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def assert_whole(out: str) -> None:
    """No number printed is nan or inf, and every row of a markdown table has its header's cells.

    Example: ``| a | b |`` then ``|---|---|`` then ``| 1 | 2 |`` is whole; ``| 1 |`` under it is not.
    """
    assert not re.search(r"\b(nan|inf)\b", out, re.IGNORECASE), out[-3000:]
    header: int | None = None
    for line in out.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = len(line.strip().strip("|").split("|"))
        header = cells if header is None else header
        assert cells == header, f"{line!r} has {cells} cells under a header of {header}"


def lines_starting(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


@pytest.mark.benchmark_run("bench_callback.py", "--steps", "51", "--repeats", "1", "--all-on")
def test_bench_callback_prints_the_hook_costs_and_what_each_part_costs(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("cpu: 51 steps x 1 repeats"), out[:300]
    assert "whole runs: without monitor" in out
    for label in ("monitor (defaults)", "monitor + 3 corrections"):
        assert lines_starting(out, f"{label}: hook on logged steps (1): median "), out
        assert lines_starting(out, f"{label}: hook averaged over all steps at the default interval: "), out
    for part in ("statistics without strata or corrections", "strata: policy lag", "correction geo"):
        assert f"  {part} " in out, out


@pytest.mark.benchmark_run("bench_correction_demo.py", *"--seeds 0 --steps 4 --eval-every 2 --lags 16".split(),
                            "--corrections", "token_truncate:2.0", "--out", "curves.csv")
def test_bench_correction_demo_prints_the_comparison(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert "| sampler, loss | policy reward at step 2 | step 4 |" in out, out[-3000:]
    for variant in ("every step", "every 16 steps, Loops' ratio", "every 16 steps, token_truncate"):
        assert f"| synced {variant}" in out, out[-3000:]
    assert (benchmark_run.folder / "curves.csv").read_text().startswith("variant,seed,step,sampled_reward,policy_reward,k3")


@pytest.mark.benchmark_run("bench_corrections.py", "--datums", "4", "--length", "32", "--repeats", "1")
def test_bench_corrections_prints_a_row_per_correction(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("CPU: "), out[:300]
    assert "| DivergenceStats.from_batch (monitor, logged step) |" in out
    for label in (
        "shadow: sequence_mask |",
        "shadow: geo |",
        "shadow: off_policy_mask:0.01 |",
        "shadow: sequence_mask + geo + token_tis |",
    ):
        assert label in out, out


@pytest.mark.benchmark_run("bench_demo.py", "--configs", "rl_tiny", "--max-steps", "2", "--skip-startup")
def test_bench_demo_times_a_shipped_config(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("CPU: ") and "bf16/float32 matmul time" in out, out[:300]
    (row,) = lines_starting(out, "| rl_tiny | ")
    assert row.split(" | ")[5] == "2", row  # the steps the clock counted
    assert not list(benchmark_run.folder.glob("bench_demo_*"))  # each run's directory is removed


@pytest.mark.benchmark_run("bench_diagnosis.py", "--tables", "--quick", "--cache-dir", "cache")
def test_bench_diagnosis_tables_prints_the_tuning_and_every_held_out_table(benchmark_run: BenchmarkRun) -> None:
    out, cache = benchmark_run.out, benchmark_run.folder / "cache"
    assert_whole(out)
    assert out.startswith("CPU: "), out[:300]
    tuning, seen, seen_after, held_out = out.split("\nHeld-out set ")
    assert seen.startswith("1, seen (rules were designed looking at it)"), seen[:300]
    assert seen_after.startswith("2, seen (held out for one rule change, then looked at)"), seen_after[:300]
    assert held_out.startswith("3, held out (never tuned on)"), held_out[:300]
    assert "Per fault setting (named cause: steps):\n  float32, synced: " in tuning
    for table, cause in ((tuning, "seeded cause"), *((table, "true cause") for table in (seen, seen_after, held_out))):
        assert f"| {cause} | impossible_inputs | none |" in table, table[-3000:]
        assert "Precision when a cause is named (right / named):" in table
    for heldout in (seen, seen_after, held_out):
        for row in ("temperature", "stale", "stale (prefix cache)", "shift", "template", "dropout"):
            assert f"| {row} |" in heldout, heldout[-3000:]
        for variant in ("flat", "peaked"):
            assert f"\n  {variant}: template: extra BOS: " in heldout, heldout[-3000:]
    assert "peaked: stale prefix KV cache (4 steps):" in seen and "flat: offset +1:" in seen
    assert "peaked: stale prefix KV cache (2 steps):" in seen_after and "flat: bf16 + offset +1:" in seen_after
    assert "peaked: stale prefix KV cache (3 steps):" in held_out and "flat: bf16 + offset +2:" in held_out
    assert [p.suffix for p in cache.iterdir()] == [".pt"] * 6  # one file per set and variant, in the given folder


@pytest.mark.benchmark_run("bench_distributed.py", *"--worlds 2 --repeats 1 --model-worlds 2 --model-repeats 1".split())
def test_bench_distributed_checks_both_schemes_and_prints_the_model(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    # whole but the fit: fitted to one world's two points, the bandwidth may be infinite
    assert_whole(re.sub(r"\nModel fitted to these runs.*?\n\n", "\n", out, flags=re.DOTALL))
    for scheme in ("current", "new"):
        assert lines_starting(out, f"| 2 | {scheme} | "), out  # part 1, gloo processes
        assert lines_starting(out, f"| 2 | 16M | {scheme} | "), out  # part 2, the cost model
    assert "  checked on 2 ranks: both schemes equal the single-process union" in out
    bound = r"^At 1,024 ranks the new scheme receives \d\.\d{3} MB per rank \(bound: 4 MB\)\.$"
    assert re.search(bound, out, re.MULTILINE), out


@pytest.mark.benchmark_run("bench_dpo_setup_memory.py", "--pairs", "16", "--length", "16")
def test_bench_dpo_setup_memory_prints_a_row_per_size(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["16", "496"]], out
    assert all(re.fullmatch(r"[0-9a-f]{16}", row[4]) for row in rows), out


@pytest.mark.benchmark_run("bench_memory.py", "--tokens", "20480")
def test_bench_memory_prints_the_copies_per_token(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert re.search(
        r"^ +20,480 tokens: peak \+\d+ MiB = \d+\.\d\d float64 copies per token \(target <= 6\)$", out, re.MULTILINE
    ), out
    assert lines_starting(out, "worst ratio "), out


@pytest.mark.benchmark_run("bench_rank_checks.py", "--repeats", "1")
def test_bench_rank_checks_prints_each_check_on_two_ranks(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("median of 1 runs, milliseconds (2 gloo ranks, torch threads 1)"), out[:300]
    for name in (
        "demo 1,024 pairs: dpo_data() on 2 ranks",
        "demo 2,048 datums: token-id check before scoring",
        "chat 512 records: preference_pairs on all",
    ):
        assert re.search(rf"^  {re.escape(name)}.* \d+\.\d \| +\d+\.\d +\d+\.\d$", out, re.MULTILINE), out


@pytest.mark.benchmark_run("bench_reference.py", "--quick", "--delay", "0.001", "--budgets", "1024")
def test_bench_reference_prints_the_remote_and_local_rows(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    for row in (
        "remote async client, 64 x 1 ms",
        "remote futures client, 64 x 1 ms",
        "local scorer, budget 2048",
        "  max_tokens_per_batch=1024",
    ):
        assert lines_starting(out, row), out
    assert "results identical" in out and json.loads(out.splitlines()[-1])["total_s"] > 0


@pytest.mark.benchmark_run("bench_reference_cache.py", "--tokens", "10000", "--tokens-per-datum", "100")
def test_bench_reference_cache_prints_both_loads(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("cache: 100 datums, 10,000 tokens"), out
    for method in ("read ", "mmap "):
        assert re.search(rf"^{method}.* s  RssAnon \+ *-?\d+\.\d MiB  RssFile \+ *-?\d+\.\d MiB", out, re.MULTILINE), (
            out
        )


@pytest.mark.benchmark_run("bench_rl_metrics.py", "--datums", "20", "--length", "50", "--repeats", "1")
def test_bench_rl_metrics_prints_every_timing_and_the_memory(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("20 datums x 50 positions = 1,000 positions"), out[:300]
    for row in ("  tensor rows ", "  padded [B, T] ", "  list TensorData "):
        assert lines_starting(out, row), out
    assert re.search(r"^  tensor +\d+\.\d\n  list +\d+\.\d$", out, re.MULTILINE), out


@pytest.mark.benchmark_run("bench_token_logprobs.py", "--shape", "2", "8", "64", "--repeats", "1")
def test_bench_token_logprobs_finds_every_path_within_rounding(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    rows = out.splitlines()[1:]
    found = [re.search(r"ratio +([\d.]+) +max\|diff\| (\S+) +bias (before (\S+) now (\S+)|\(a gradient\))$", row)
             for row in rows]
    assert len(rows) == 6 and all(found), out
    for match in found:
        assert float(match[2]) < 1e-4, out  # the old route's rounding at most
        if match[4] is not None:
            assert abs(float(match[5])) <= abs(float(match[4])) + 1e-6, out


@pytest.mark.benchmark_run(
    "bench_tokenization_memory.py", "--formats", "standard", "--window-mb", "0.01", "--whole-mb", "0.01"
)
def test_bench_tokenization_memory_prints_both_paths(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [
        ["standard", "whole", "0.0"],
        ["standard", "window", "0.0"],
    ], out
    assert out.splitlines()[-1].endswith("True"), out  # the window's ids are the whole text's


@pytest.mark.benchmark_run("demo_learning.py", "--rl-steps", "2", "--dpo-steps", "2", "--dpo-pairs", "32", "--variants")
def test_demo_learning_prints_rl_dpo_and_the_variants(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert lines_starting(out, "RL   2 steps: reward ") and lines_starting(out, "DPO  2 steps (beta=0.1, 32 pairs)"), (
        out
    )
    assert len(lines_starting(out, "RL   ")) == 4, out


@pytest.mark.benchmark_run(
    "real_model_power.py", *"--settings top_p0.9 --tokens 8 16 --draws 2 --max-new-tokens 8 --batch 4".split(),
    "--cache-dir", os.environ.get("LOOPS_CALLBACKS_CACHE") or "cache",  # else built in the run's folder (about 30 s)
)
def test_real_model_power_prints_a_cell_per_setting_and_step_size(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    assert out.startswith("CPU: "), out[:300]
    assert re.search(r"^\| top-p 0\.9, raw logprobs \| \d+\.\d \([0-2]/2\) \| \d+\.\d \([0-2]/2\) \|$", out, re.MULTILINE), out
    assert lines_starting(out, "| top-p 0.9, raw logprobs | "), out  # the pool's row
    check = re.search(r"logprob (\S+), entropy (\S+), varentropy (\S+)$", out, re.MULTILINE)
    assert check and all(float(value) < 1e-3 for value in check.groups()), out  # the generate logits are the trainer's


@pytest.mark.benchmark_run("creeping_rule.py", "--runs", "3", "--steps", "40", "--no-fault")
def test_creeping_rule_prints_a_row_per_setting(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    for threshold, growth in (("3", "mean"), ("2.33", "median")):
        assert re.search(rf"^\| {threshold} \| {growth} \|( \d+% \|){{3}} — \|$", out, re.MULTILINE), out


@pytest.mark.benchmark_run("tune_diagnosis.py", "--base-steps", "2", "--steps", "2", "--skip", "0", "--seeds", "0")
def test_tune_diagnosis_prints_each_variant(benchmark_run: BenchmarkRun) -> None:
    out = benchmark_run.out
    assert_whole(out)
    for variant in ("every rule", "trend, no token identity", "token identity, no trend"):
        assert lines_starting(out, f"{variant}: right when a cause is named "), out


def test_gpu_checks_without_cuda_say_so_in_one_line_and_write_nothing(tmp_path: Path) -> None:
    before = sorted(p.name for p in ROOT.iterdir())
    done = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_checks.sh"), str(tmp_path / "out")],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and "no CUDA device" in done.stderr
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_gpu_profile_without_cuda_says_so_in_one_line() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_profile.py"), "--quick"], cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.strip().splitlines() == [
        "gpu_profile.py: no CUDA device here; nothing was run"]
