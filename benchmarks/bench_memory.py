"""Peak host memory of one logged step of KLSampleTrainMonitor, in float64 copies per token.

One logged step is what the monitor runs on a step it logs: ``read_step`` (the batch into a
``FlatBatch``), ``DivergenceStats.from_batch`` (signatures, worst tokens and the percentile sample
on, as by default; every stratum, with a policy version and a group per row), ``to_host`` and
``step_report`` (scalars, diagnosis, histogram values, worst-token rows, the guard rail's
judgement). The batch is padded ``[B, T]`` float32 logprobs, a float32 mask and int64 target
tokens, every position an action token; the inputs themselves are not counted.

Each size runs in a fresh process whose large allocations all go through ``mmap``
(``MALLOC_MMAP_THRESHOLD_``), so the resident set is the live memory and its high-water mark
(``ru_maxrss``) minus the mark before the step is the step's peak. The ratio printed is that
peak over 8 bytes x tokens (one float64 copy of the batch); the target is <= 6.

    python benchmarks/bench_memory.py              # 1M and 10M tokens
    python benchmarks/bench_memory.py --tokens 1000000
    python benchmarks/bench_memory.py --no-strata   # the step without the divergence by stratum
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLUMNS = 2048
TARGET_COPIES = 6.0


def logged_step(batch: dict, strata: bool) -> None:
    """One logged step on one rank, as the monitor runs it (the batch is kept while it is read)."""
    import torch

    from loops_callbacks.divergence.guard_rail import GuardRail
    from loops_callbacks.divergence.report import ReportOptions, step_report
    from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
    from loops_callbacks.divergence.batch import ReadOptions, read_step

    flat = read_step({}, batch, ReadOptions(with_tokens=True), optimizer_step=10 if strata else None)
    stats = DivergenceStats.from_batch(
        flat, StatisticsOptions(top_n=20, sample_size=100_000, max_groups=8 if strata else None),
        generator=torch.Generator().manual_seed(0),
    )
    step_report(
        stats.to_host(),
        ReportOptions(prefix="optim/train-sample-div/"),
        guard_rail=GuardRail(max_kl=0.05, kl_metric="kl_sample_train_k3"),
    )


def child(tokens: int, strata: bool) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    rows = tokens // COLUMNS
    generator = torch.Generator().manual_seed(0)
    batch = {
        "logprobs": -torch.rand(rows, COLUMNS, generator=generator) * 5,
        "training_logprobs": -torch.rand(rows, COLUMNS, generator=generator) * 5,
        "mask": torch.ones(rows, COLUMNS),
        "target_tokens": torch.randint(0, 50_000, (rows, COLUMNS), generator=generator),
        "policy_version": torch.randint(0, 11, (rows,), generator=generator),
        "group": torch.randint(0, 12, (rows,), generator=generator),
    }
    small = {key: value[:2, :64].clone() if value.dim() == 2 else value[:2].clone() for key, value in batch.items()}
    logged_step(small, strata)  # imports and one-time allocations are not the step's
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logged_step(batch, strata)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n = rows * COLUMNS
    return {"tokens": n, "peak_bytes": after - before, "copies": (after - before) / (8 * n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1_000_000, 10_000_000])
    parser.add_argument("--no-strata", action="store_true", help="without the divergence by stratum")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, strata=not args.no_strata)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    worst = 0.0
    for tokens in args.tokens:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(tokens), *(["--no-strata"] if args.no_strata else [])],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        worst = max(worst, result["copies"])
        print(
            f"{result['tokens']:>11,} tokens: peak +{result['peak_bytes'] / 2**20:,.0f} MiB "
            f"= {result['copies']:.2f} float64 copies per token (target <= {TARGET_COPIES:g})"
        )
    print(f"worst ratio {worst:.2f}: {'meets' if worst <= TARGET_COPIES else 'MISSES'} the target")


if __name__ == "__main__":
    main()
