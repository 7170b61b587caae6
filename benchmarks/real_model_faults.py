"""The diagnosis on a real LLM: SmolLM2-135M-Instruct in a GRPO-style loop, healthy and with each fault.

Each run is ``benchmarks/real_model.py``'s ``RealGRPO`` (8 sequences a step: 2 chat prompts x 4, up to 32
completion tokens, lr 5e-6, the monitor logging every step with ``policy_version`` and the sampler's facts
given) for ``--steps`` optimizer steps; the table counts the causes named per run, and the first step each
run's expected cause was named at. ``--held-out`` draws the prompts from the set no threshold was set on::

    OMP_NUM_THREADS=2 python benchmarks/real_model_faults.py --steps 6
    OMP_NUM_THREADS=2 python benchmarks/real_model_faults.py --steps 6 --held-out --runs none,stale
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402
from real_model import HELD_OUT_QUESTIONS, QUESTIONS, build, real_grpo  # noqa: E402

RUNS: dict[str, tuple[dict[str, Any], str]] = {
    # name: (RealGRPO options, the cause it should be named)
    "none": ({}, "precision|none"),
    "none_bf16": ({"sampler_dtype": "bfloat16"}, "precision|none"),
    "stale": ({"fault": "stale"}, "stale"),
    "failed_sync": ({"fault": "failed_sync"}, "stale|unrelated"),
    "processed_T0.7": ({"temperature": 0.7, "logprobs_mode": "processed_logprobs"}, "temperature"),
    "raw_T0.7": ({"temperature": 0.7}, "sampling"),
    "processed_top_p0.9": ({"top_p": 0.9, "logprobs_mode": "processed_logprobs"}, "truncation"),
    "system_prompt": ({"fault": "system_prompt"}, "prompt"),
    "shift": ({"fault": "shift"}, "shift"),
    "top_k_50": ({"fault": "top_k_50"}, "sampling"),
}


def run(model_dir: Any, options: dict[str, Any], steps: int, held_out: bool, seed: int) -> list[str]:
    """The cause named at each logged step of one run."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor

    seed_everything(seed, verbose=False)
    questions = HELD_OUT_QUESTIONS if held_out else QUESTIONS
    module = real_grpo(model_dir, questions=questions, **options)
    causes: list[str] = []

    class Record(KLSampleTrainMonitor):
        def on_train_batch_end(self, *args: Any) -> None:
            before = self.history.judged_steps
            super().on_train_batch_end(*args)
            if self.history.judged_steps > before and self.last_diagnosis is not None:
                causes.append(self.last_diagnosis.label)

    monitor = Record(log_every_n_steps=1)
    Trainer(max_steps=steps, callbacks=[monitor], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0).fit(module)
    return causes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated, of: " + ", ".join(RUNS))
    parser.add_argument("--held-out", action="store_true", help="the prompts no threshold was set on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    model_dir = build(args.cache_dir)
    print(f"# {cpu_name()}; {args.steps} steps a run, {'held-out' if args.held_out else 'tuning'} prompts, "
          f"seed {args.seed}")
    print("| run | named (steps) | expected | first step named |")
    print("|---|---|---|---|")
    for name in args.runs.split(","):
        options, expected = RUNS[name]
        start = time.perf_counter()
        causes = run(model_dir, options, args.steps, args.held_out, args.seed)
        counts = collections.Counter(causes)
        named = ", ".join(f"{cause} {count}" for cause, count in counts.most_common())
        hits = [i for i, cause in enumerate(causes) if any(part in cause for part in expected.split("|"))]
        first = str(hits[0]) if hits else "never"
        print(f"| {name} | {named} | {expected} | {first} | ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
