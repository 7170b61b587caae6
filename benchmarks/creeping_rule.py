"""The creeping rule's trade-off: how often it names healthy noise, against how soon it names a real fault.

Healthy runs: ``--runs`` series of ``--steps`` relative gaps, i.i.d. log-normal with spread sigma (a bf16 sampler's
gaps on SmolLM2 scatter like sigma 0.6), each judged at every step over the run's latest 32 (``TREND_STEPS``), as
the monitor does. The fault: ``benchmarks/real_model.py``'s failed sync (versions still counting) with a bf16
sampler, ``--fault-steps`` steps on SmolLM2 (``--no-fault`` skips it). Each row is one setting of the rule: the
Spearman threshold rho sqrt(n - 1) and whether growth is the mean or the median of the thirds::

    OMP_NUM_THREADS=2 python benchmarks/creeping_rule.py --cache-dir /tmp/rm_cache
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402

SETTINGS = ((3.0, "mean"), (2.6, "mean"), (2.33, "mean"), (2.33, "median"))  # the first is the rule's


def fires(series: Sequence[float], z: float, growth_of: Callable[[Sequence[float]], float]) -> bool:
    """Whether the creeping rule, at threshold ``z`` and with ``growth_of`` a third, names this series."""
    from loops_callbacks.divergence.diagnosis import CREEP_GROWTH, CREEP_STEPS, _spearman

    if len(series) < CREEP_STEPS:
        return False
    third = max(1, len(series) // 3)
    early, late = growth_of(series[:third]), growth_of(series[-third:])
    return late >= CREEP_GROWTH * early and _spearman(series) * math.sqrt(len(series) - 1) >= z


def false_alarm_share(sigma: float, z: float, growth_of: Callable[[Sequence[float]], float], runs: int,
                      steps: int) -> float:
    """The share of healthy runs named creeping at some step."""
    import torch

    from loops_callbacks.divergence.diagnosis import TREND_STEPS

    named = 0
    for seed in range(runs):
        gaps = (1e-4 * torch.exp(sigma * torch.randn(steps, generator=torch.Generator().manual_seed(seed)))).tolist()
        named += any(fires(gaps[max(0, i - TREND_STEPS + 1): i + 1], z, growth_of) for i in range(steps))
    return named / runs


def fault_gaps(cache_dir: str | None, steps: int) -> list[float]:
    """The relative gap of each step of a bf16 sampler's failed sync on SmolLM2."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor
    from real_model import build, real_grpo

    seed_everything(0, verbose=False)
    gaps: list[float] = []

    class Recording(KLSampleTrainMonitor):
        def on_train_batch_end(self, *args: object) -> None:
            super().on_train_batch_end(*args)
            gaps.append(self.last_metrics[self.prefix + "signature/relative_gap"])

    Trainer(max_steps=steps, callbacks=[Recording(log_every_n_steps=1)], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(
        real_grpo(build(cache_dir), fault="failed_sync", sampler_dtype="bfloat16"))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--sigmas", default="0.6,0.8,1.0")
    parser.add_argument("--fault-steps", type=int, default=15)
    parser.add_argument("--no-fault", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    sigmas = [float(s) for s in args.sigmas.split(",")]
    fault = [] if args.no_fault else fault_gaps(args.cache_dir, args.fault_steps)
    print(f"# {cpu_name()}; {args.runs} healthy runs of {args.steps} steps per sigma"
          + ("" if args.no_fault else f"; the fault's gaps: {', '.join(f'{g:.2g}' for g in fault)}"))
    print("| rho sqrt(n-1) >= | growth of the thirds | " + " | ".join(f"healthy runs named, sigma {s}" for s in sigmas)
          + " | the fault named at step |")
    print("|---|---|" + "---|" * len(sigmas) + "---|")
    for z, kind in SETTINGS:
        growth_of = statistics.fmean if kind == "mean" else statistics.median
        shares = [false_alarm_share(s, z, growth_of, args.runs, args.steps) for s in sigmas]
        step = next((i for i in range(len(fault)) if fires(fault[: i + 1], z, growth_of)), None)
        named = "—" if args.no_fault else ("never" if step is None else str(step))
        print(f"| {z:g} | {kind} | " + " | ".join(f"{share:.0%}" for share in shares) + f" | {named} |")


if __name__ == "__main__":
    main()
