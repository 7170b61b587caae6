"""How often the divergence diagnosis names the seeded cause, per monitor step, on the RL demo.

A base policy is trained fault-free (``RLPolicyModule`` defaults, float32 sampler synced every
step) for ``--base-steps`` steps. Then each seeded fault runs from that policy for ``--steps``
optimizer steps, with ``KLSampleTrainMonitor`` logging every step (16 prompts x 8 completions,
about 640 action tokens per monitor step), on seeds the rule's thresholds were not tuned on
(``--seeds``; the thresholds were set looking at seeds 100-101). Each logged step's diagnosis is
one entry of the confusion table (rows: the seeded cause, columns: the named cause).

The first ``--skip`` steps of every run are left out: in the stale run the sampler is then
at most that many optimizer steps behind (a gap below precision noise), and it keeps runs
comparable.

    python benchmarks/bench_diagnosis.py                     # 3 seeds x 12 faults x 20 steps
    python benchmarks/bench_diagnosis.py --seeds 0 --steps 8  # quick look
    python benchmarks/bench_diagnosis.py --signatures         # also print the mean signature per fault
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import loops_callbacks.divergence.monitor as monitor_module  # noqa: E402
from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.demo import PromptDataModule, RLPolicyModule  # noqa: E402
from loops_callbacks.divergence.diagnosis import CAUSES  # noqa: E402
from loops_callbacks.divergence.signatures import SIGNATURES, signature_numbers  # noqa: E402

FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "float32, synced": ("none", {}),
    "bf16 sampler": ("precision", {"sampler_precision": "bfloat16"}),
    "temperature 0.7": ("temperature", {"sampler_temperature": 0.7}),
    "temperature 1.3": ("temperature", {"sampler_temperature": 1.3}),
    "top-k 3": ("truncation", {"sampler_top_k": 3}),
    "top-p 0.9": ("truncation", {"sampler_top_p": 0.9}),
    "shift +1": ("shift", {"logprob_shift": 1}),
    "shift -1, bf16": ("shift", {"logprob_shift": -1, "sampler_precision": "bfloat16"}),
    "template: no <bos>": ("unrelated", {"sampler_prompt": "no_bos"}),
    "stale: never synced": ("stale", {"sync_every": None}),
    "stale: synced every 8": ("stale", {"sync_every": 8}),
    "template: <pad> as <bos> (slight)": ("template, slight", {"sampler_prompt": "pad_as_bos"}),
}
"""Fault settings the rule's thresholds were set on (with seeds 100-101)."""

OTHER_FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "float32, synced": ("none", {}),
    "bf16 sampler": ("precision", {"sampler_precision": "bfloat16"}),
    "temperature 0.8": ("temperature", {"sampler_temperature": 0.8}),
    "temperature 1.5": ("temperature", {"sampler_temperature": 1.5}),
    "top-k 5": ("truncation", {"sampler_top_k": 5}),
    "top-p 0.95, bf16": ("truncation", {"sampler_top_p": 0.95, "sampler_precision": "bfloat16"}),
    "shift -1": ("shift", {"logprob_shift": -1}),
    "shift +1, bf16": ("shift", {"logprob_shift": 1, "sampler_precision": "bfloat16"}),
    "template: no <bos>, bf16": ("unrelated", {"sampler_prompt": "no_bos", "sampler_precision": "bfloat16"}),
    "stale: synced every 4": ("stale", {"sync_every": 4}),
    "stale: never synced, bf16": ("stale", {"sync_every": None, "sampler_precision": "bfloat16"}),
}
"""Other settings, for ``--other`` (with ``--base-steps 300``: another checkpoint too)."""


class Recorder:
    """While open, keeps each logged step's named cause, signatures, and whether the sampler had
    just been synced (then a stale run has, truly, no mismatch): it wraps the monitor's one
    report function, ``step_report``, which sees the step's host statistics."""

    def __init__(self, module: RLPolicyModule) -> None:
        self.steps: list[tuple[str, dict[str, float], bool]] = []
        self.module = module

    def __enter__(self) -> Recorder:
        self.original = monitor_module.step_report

        def report_and_keep(host: Any, **options: Any) -> Any:
            report = self.original(host, **options)
            if report.diagnosis is not None:
                module = self.module
                fresh = module.sampler_synced_at_step == module.trainer.global_step - 1  # after its optimizer step
                self.steps.append((report.diagnosis.cause, signature_numbers(host), fresh))
            return report

        monitor_module.step_report = report_and_keep
        return self

    def __exit__(self, *exc: object) -> None:
        monitor_module.step_report = self.original


def _trainer(steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=callbacks, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def train_base(steps: int, seed: int) -> dict[str, torch.Tensor]:
    pl.seed_everything(seed, verbose=False)
    module = RLPolicyModule()
    _trainer(steps, []).fit(module, PromptDataModule(seed=seed))
    return {k: v.clone() for k, v in module.policy.state_dict().items()}


def run_fault(
    base: dict[str, torch.Tensor], options: dict[str, Any], steps: int, seed: int
) -> list[tuple[str, dict[str, float], bool]]:
    pl.seed_everything(seed, verbose=False)
    module = RLPolicyModule(**options)
    module.policy.load_state_dict(base)
    monitor = KLSampleTrainMonitor(log_histogram=False, log_worst_tokens=False, log_every_n_steps=1)
    with Recorder(module) as recorder:
        _trainer(steps, [monitor]).fit(module, PromptDataModule(seed=seed))
    return recorder.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--signatures", action="store_true")
    parser.add_argument("--other", action="store_true", help="the other fault settings (OTHER_FAULTS)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    base = train_base(args.base_steps, seed=12345)
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    by_fault: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    faults = OTHER_FAULTS if args.other else FAULTS
    per_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for name, (cause, options) in faults.items():
        for seed in args.seeds:
            for named, signatures, fresh in run_fault(base, options, args.steps + args.skip, seed)[args.skip :]:
                truth = "none" if fresh and cause == "stale" else cause  # just synced: no mismatch
                table[truth][named] += 1
                per_fault[name][named] += 1
                by_fault[name].append(signatures)
    print(f"Base policy: {args.base_steps} fault-free steps; per fault {len(args.seeds)} seed(s) x {args.steps} "
          f"monitor steps (seeds {args.seeds}).\n")
    shown = list(CAUSES)
    print("| seeded cause | " + " | ".join(shown) + " | right |")
    print("|---|" + "---|" * (len(shown) + 1))
    for cause in [*CAUSES, "template, slight"]:
        if cause not in table:
            continue
        row = table[cause]
        total = sum(row.values())
        right = f"{row[cause] / total:.0%}" if cause in CAUSES else "(known confusion)"
        print(f"| {cause} | " + " | ".join(str(row[c]) for c in shown) + f" | {right} |")
    print("\nPer fault setting (named cause: steps):")
    for name, counts in per_fault.items():
        print(f"  {name}: " + ", ".join(f"{cause} {count}" for cause, count in counts.most_common()))
    if args.signatures:
        print("\nMean signature per fault (median over steps):")
        print("| fault | " + " | ".join(SIGNATURES) + " |")
        for name, rows in by_fault.items():
            medians = [np.nanmedian([r[s] for r in rows]) for s in SIGNATURES]
            print(f"| {name} | " + " | ".join(f"{m:.3g}" for m in medians) + " |")


if __name__ == "__main__":
    main()
