"""Cost of each correction's shadow statistics, side by side with the monitor's own statistics of the same batch.

For a batch of B datums x T positions (sampler-trainer gaps of a few hundredths of a nat, ~10%
of positions masked out, one advantage per datum), times in one process:

* ``DivergenceStats.from_batch`` as the monitor calls it on a logged step (``top_n=20``,
  ``sample_size=100_000``, the diagnosis' sums on): the reference;
* ``shadow_values`` of each correction alone, and of three together (``sequence_mask``, ``geo``,
  ``token_tis``: the issue's overhead target is for three), each as a ratio to the reference.

The batch is flattened once (``flatten_padded``); the median of ``--repeats`` runs is reported.
Torch runs on one thread by default (``--threads`` to change), like the rest of the benchmarks.

    python benchmarks/bench_corrections.py            # 64 x 2,048
    python benchmarks/bench_corrections.py --quick    # 16 x 256, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(__file__))

from loops_callbacks.correction import METHODS  # noqa: E402
from loops_callbacks.divergence.batch import FlatBatch, flatten_padded  # noqa: E402
from loops_callbacks.divergence.statistics import parse_corrections, shadow_values  # noqa: E402
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions  # noqa: E402
from machine import cpu_name  # noqa: E402

BOUNDS = {"token_k1": "2.0", "token_k2": "0.1", "token_k3": "0.05", "seq_sum_k1": "0.5_2.0", "seq_sum_k2": "1.0",
          "seq_sum_k3": "0.5", "seq_mean_k1": "0.9_1.1", "seq_mean_k2": "0.01", "seq_mean_k3": "0.01",
          "seq_max_k2": "0.5", "seq_max_k3": "0.5", "off_policy_mask": "0.01"}
THREE = ["sequence_mask", "geo", "token_tis"]


def make_batch(n_datums: int, length: int, seed: int = 0) -> tuple[FlatBatch, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sampler = -torch.empty(n_datums, length).exponential_(1.0, generator=generator)
    trainer = (sampler + torch.randn(n_datums, length, generator=generator) * 0.05).clamp(max=0.0)
    mask = (torch.rand(n_datums, length, generator=generator) > 0.1).float()
    advantages = torch.randn(n_datums, generator=generator)
    flat = flatten_padded(sampler_logprobs=sampler, training_logprobs=trainer, mask=mask)
    return flat, advantages


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datums", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="16 x 256, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.datums, args.length, args.repeats = 16, 256, 3
    torch.set_num_threads(args.threads)
    flat, advantages = make_batch(args.datums, args.length)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} thread(s)")
    print(f"Batch: {args.datums} datums x {args.length} positions, median of {args.repeats} runs")

    def reference() -> object:
        generator = torch.Generator().manual_seed(0)
        return DivergenceStats.from_batch(flat, StatisticsOptions(top_n=20, sample_size=100_000), generator=generator)

    base = median_seconds(reference, args.repeats)
    print("| statistics | ms | ratio to DivergenceStats.from_batch |\n|---|---:|---:|")
    print(f"| DivergenceStats.from_batch (monitor, logged step) | {base * 1e3:.2f} | 1.00 |")
    specs = [f"{m}:{BOUNDS[m]}" if m in BOUNDS else m for m in METHODS]
    for label, listed in [*((s, [s]) for s in specs), (" + ".join(THREE), THREE)]:
        corrections = parse_corrections(listed)
        seconds = median_seconds(lambda c=corrections: shadow_values(flat, c, advantages), args.repeats)
        print(f"| shadow: {label} | {seconds * 1e3:.2f} | {seconds / base:.3f} |")


if __name__ == "__main__":
    main()
