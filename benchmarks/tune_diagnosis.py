"""Which evidence of staleness works at the monitor's batch sizes, on the tuning generator only.

Runs the seeded faults of ``bench_diagnosis`` (``FAULTS``, or ``OTHER_FAULTS`` with ``--other``)
through ``KLSampleTrainMonitor``, keeps each logged step's signatures and k3, and names each step
three ways: with every rule, with the run's trend (of the relative gap) as the only evidence of staleness that is
not a policy version (token identity off), and with token identity only (no trend). The demo
carries no policy versions, so the per-lag rule is exercised by the unit tests, not here. Never
run this on the held-out generator: thresholds are set here and reported there.

    python benchmarks/tune_diagnosis.py --seeds 0 1 --steps 20
    python benchmarks/tune_diagnosis.py --seeds 0 1 --steps 20 --other
    python benchmarks/tune_diagnosis.py --base-steps 2 --steps 2 --skip 0 --seeds 0   # a smoke run
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_diagnosis  # noqa: E402

import loops_callbacks.divergence.monitor as monitor_module  # noqa: E402
from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.demo import PromptDataModule, RLPolicyModule  # noqa: E402
from loops_callbacks.divergence import diagnosis  # noqa: E402
from loops_callbacks.divergence.diagnosis import CAUSES  # noqa: E402
from loops_callbacks.divergence.statistics import signature_numbers  # noqa: E402
from loops_callbacks.divergence.monitor import MediaOptions


def record(
    base: dict[str, torch.Tensor], options: dict[str, Any], steps: int, seed: int, skip: int = 0
) -> list[dict[str, Any]]:
    """Each logged step's signatures, token count, noise floor and whether the sampler was just synced;
    the faults start after ``skip`` healthy steps (``bench_diagnosis.with_healthy_start``)."""
    pl.seed_everything(seed, verbose=False)
    module = RLPolicyModule(**bench_diagnosis.with_healthy_start(options, skip))
    module.policy.load_state_dict(base)
    kept: list[dict[str, Any]] = []
    original = monitor_module.step_report

    def report_and_keep(host: Any, *args: Any, **report_options: Any) -> Any:
        calibration = report_options.get("calibration")
        kept.append(
            {
                "signatures": signature_numbers(host),
                "n_tokens": host.totals["n_action_tokens"],
                "noise_floor": calibration.noise_floor if calibration is not None else None,
                "fresh": module.sampler_synced_at_step == module.trainer.global_step - 1,
            }
        )
        return original(host, *args, **report_options)

    monitor_module.step_report = report_and_keep
    try:
        monitor = KLSampleTrainMonitor(
            media=MediaOptions(log_histogram=False, log_worst_tokens=False), log_every_n_steps=1)
        bench_diagnosis._trainer(steps, [monitor]).fit(module, PromptDataModule(seed=seed))
    finally:
        monitor_module.step_report = original
    return kept


def named(steps: list[dict[str, Any]], *, trend: bool, token_identity: bool) -> list[str]:
    """The cause of each step of one run, the trend built from the run's own earlier steps."""
    causes, history = [], []
    eta2 = diagnosis.STALE_ETA2
    diagnosis.STALE_ETA2 = eta2 if token_identity else float("inf")
    try:
        for step in steps:
            sig = step["signatures"]
            found = diagnosis.diagnose(
                sig, n_tokens=step["n_tokens"], noise_floor=step["noise_floor"],
                trend=tuple(history[-diagnosis.TREND_STEPS :]) if trend else (),
            )
            history.append(sig["relative_gap"])
            causes.append(found.cause)
    finally:
        diagnosis.STALE_ETA2 = eta2
    return causes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=bench_diagnosis.HEALTHY_STEPS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--other", action="store_true")
    parser.add_argument("--base-steps", type=int, default=None,
                        help="fault-free steps of the base policy (default 150; 300 with --other)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    faults = bench_diagnosis.OTHER_FAULTS if args.other else bench_diagnosis.FAULTS
    base_steps = args.base_steps if args.base_steps is not None else 300 if args.other else 150
    base = bench_diagnosis.train_base(base_steps, seed=12345)
    variants = {
        "every rule": (True, True),
        "trend, no token identity": (True, False),
        "token identity, no trend": (False, True),
    }
    tables = {name: collections.defaultdict(collections.Counter) for name in variants}
    for fault, (cause, options) in faults.items():
        for seed in args.seeds:
            steps = record(base, options, args.steps + args.skip, seed, args.skip)
            truths = ["none" if step["fresh"] and cause == "stale" else cause for step in steps]
            for name, (trend, token_identity) in variants.items():
                causes = named(steps, trend=trend, token_identity=token_identity)
                for truth, found in list(zip(truths, causes))[args.skip :]:
                    tables[name][truth][found] += 1
    for name, table in tables.items():
        judged = {truth: row for truth, row in table.items() if truth in CAUSES}  # not the known confusion
        named_steps = sum(n for row in judged.values() for cause, n in row.items() if cause != "unclear")
        right = sum(row[truth] for truth, row in judged.items())
        print(f"{name}: right when a cause is named {right}/{named_steps}")
        for truth, row in table.items():
            counts = ", ".join(f"{cause} {n}" for cause, n in row.most_common())
            print(f"  {truth:18s} {row[truth]:4d}/{sum(row.values()):<4d}  {counts}")


if __name__ == "__main__":
    main()
