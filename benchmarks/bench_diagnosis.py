"""How often the divergence diagnosis names the seeded cause, per monitor step, on the RL demo.

A base policy is trained fault-free (``RLPolicyModule`` defaults, float32 sampler synced every
step) for ``--base-steps`` steps. Then each seeded fault runs from that policy for ``--steps``
optimizer steps, with ``KLSampleTrainMonitor`` logging every step (16 prompts x 8 completions,
about 640 action tokens per monitor step), on seeds the rule's thresholds were not tuned on
(``--seeds``; the thresholds were set looking at seeds 100-101). Each logged step's diagnosis is
one entry of the confusion table (rows: the seeded cause, columns: the named cause).

Protocol (both generators, as in a user's run): the monitor sees ``HEALTHY_STEPS`` healthy
logged steps of the same engine (the same sampler dtype, synced, full-distribution logprobs at
temperature 1, aligned; the monitor's ``calibration_steps``) before the fault appears, and they
are left out of the tables; a template change has none (a template bug is there from the first
step). A held-out healthy engine is its own healthy steps: its first ``HEALTHY_STEPS`` calibrate
and are left out, so that no step is both calibrated on and counted. Here the seeded sampler faults start after ``--skip`` steps (``faults_from_step``); the
sampler's dtype is the engine's from the start, and a stale sampler starts in sync and drifts.
The first ``--skip`` steps are left out of every run: in the stale run the sampler is then at
most that many optimizer steps behind (a gap below precision noise).

    python benchmarks/bench_diagnosis.py                     # 3 seeds x 12 faults x 20 steps
    python benchmarks/bench_diagnosis.py --seeds 0 --steps 8  # quick look
    python benchmarks/bench_diagnosis.py --signatures         # also print the mean signature per fault
    python benchmarks/bench_diagnosis.py --tables             # the tuning table and both held-out sets' tables
    python benchmarks/bench_diagnosis.py --tables --heldout-sets 1   # the tuning table and held-out set 1's
    python benchmarks/bench_diagnosis.py --tables --quick     # all tables, tiny (a smoke run, seconds)

``--tables`` prints confusion tables (rows: the true cause, columns: the named cause, per-cause
recall, and per named cause its precision): the tuning one above (these faults, seeds 0-2), then
one per held-out set of ``heldout_faults.py`` (``--heldout-sets``), a generator that shares no code
with the demo (a Hugging Face GPT-2, flat and peaked, sampled by ``generate``; see its docstring):
set 1, "seen" (the rules were designed looking at it); set 2, "seen" (it differs from set 1 in
seed, vocabulary, chain, lengths, model size, learning rate and faults; it was held out for one
rule change, the context fade, whose failures on it shaped the next); set 3, "held out" (never
tuned on, different again).
Each held-out fault is replayed through a tiny Lightning run with ``KLSampleTrainMonitor``, so
every held-out step goes through the monitor as it is (its calibration, and whatever it reads from
the batch and the module: the per-datum ``policy_version``, the trainer model's dropout modules in
train mode, with the fault's dropout p). The held-out steps are cached per set and variant in
``--cache-dir`` (default: a folder in the system's temp dir).

Which named cause is right (``ACCEPTED``): the cause itself, any offset for a shift, and for a
template change ("template", "template, slight", the demo's "unrelated") "template" or
"unrelated". A stale prompt-prefix KV cache is stale weights whose gap sits on each completion's
first tokens, as a template change's does, so its steps get their own row, "stale (prefix cache)",
where "stale" is right. That row is set here, from the fault (``truth_row``), not by the
generator: the generator's cached steps keep the truth they were made with ("stale"), so a cache
file written before stays valid and right.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import loops_callbacks.divergence.monitor as monitor_module  # noqa: E402
from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.demo import PromptDataModule, RLPolicyModule  # noqa: E402
from loops_callbacks.divergence.diagnosis import CAUSES  # noqa: E402
from loops_callbacks.divergence.statistics import SIGNATURES, signature_numbers  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import heldout_faults  # noqa: E402
from loops_callbacks.divergence.monitor import MediaOptions
from machine import cpu_name  # noqa: E402

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
    report function, ``step_report``, which sees the step's host statistics. ``fresh`` says
    whether the sampler was just synced (``None``: never)."""

    def __init__(self, fresh: Callable[[], bool] | None = None) -> None:
        self.steps: list[tuple[str, dict[str, float], bool]] = []
        self.fresh = fresh
        self.inputs: set[str] = set()  # step_report's keyword inputs that some step set (not None)

    def __enter__(self) -> Recorder:
        self.original = monitor_module.step_report

        def report_and_keep(host: Any, *args: Any, **options: Any) -> Any:
            report = self.original(host, *args, **options)
            self.inputs.update(name for name, value in options.items() if value is not None)
            if report.diagnosis is not None:
                fresh = self.fresh() if self.fresh is not None else False
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


def with_healthy_start(options: dict[str, Any], skip: int) -> dict[str, Any]:
    """``options`` with the seeded sampler faults starting after ``skip`` healthy optimizer steps,
    except a template change (``sampler_prompt``), there from the first step (module docstring)."""
    return options if "sampler_prompt" in options else {"faults_from_step": skip, **options}


def run_fault(
    base: dict[str, torch.Tensor], options: dict[str, Any], steps: int, seed: int, skip: int = 0
) -> list[tuple[str, dict[str, float], bool]]:
    """Each logged step's named cause, signatures and freshness; the seeded sampler faults start
    after ``skip`` optimizer steps (healthy ones before), a template change from the first step."""
    pl.seed_everything(seed, verbose=False)
    module = RLPolicyModule(**with_healthy_start(options, skip))
    module.policy.load_state_dict(base)
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_histogram=False, log_worst_tokens=False), log_every_n_steps=1)
    def fresh() -> bool:  # synced after the last optimizer step
        return module.sampler_synced_at_step == module.trainer.global_step - 1

    with Recorder(fresh) as recorder:
        _trainer(steps, [monitor]).fit(module, PromptDataModule(seed=seed))
    return recorder.steps


PREFIX_CACHE = "stale (prefix cache)"
"""The true-cause row of a stale prompt-prefix KV cache's stale steps (module docstring)."""
ACCEPTED: dict[str, tuple[str, ...]] = {
    "shift": ("shift", "offset"),
    "unrelated": ("unrelated", "template"),
    "template": ("template", "unrelated"),
    "template, slight": ("template", "unrelated"),
    PREFIX_CACHE: ("stale",),
}
"""Named causes that are right for a true cause (the cause itself when not listed): an offset of
any size is a shift; a template change may be named "template" or "unrelated" (the template
checks' name). A gap on each completion's first tokens is not named (it is "unclear" with the fade)."""
HELDOUT_ACCEPTED = {**ACCEPTED, "none": ("none", "precision")}
"""On the held-out sets "none" is Hugging Face generate at fp32: its KV-cached decoding differs from
the trainer's full forward by float rounding on some tokens, so "precision" is right there too."""
HELDOUT_LABELS = {
    1: "seen (rules were designed looking at it)",
    2: "seen (held out for one rule change, then looked at)",
    3: "held out (never tuned on)",
}
"""What each held-out set is to the diagnosis' rules."""


HEALTHY_STEPS = 5
"""Healthy logged steps of the same engine the monitor sees before a fault (module docstring)."""


def healthy_engine(heldout_set: heldout_faults.HeldoutSet, dtype: str) -> heldout_faults.Fault:
    """The set's first fault whose steps are a healthy engine of sampler ``dtype``: cause "none" or
    "precision" and every other setting at its default (synced, aligned, temperature 1, no
    truncation, template or dropout; raw or processed logprobs, the same at temperature 1)."""
    for fault in heldout_set.faults:
        plain = heldout_faults.Fault(fault.name, fault.cause, logprobs=fault.logprobs, sampler_dtype=dtype)
        if fault.cause in ("none", "precision") and fault == plain:
            return fault
    raise ValueError(f"held-out set {heldout_set.name!r} has no healthy {dtype} engine among its faults")


def healthy_prefix(
    data: dict[str, list[dict[str, Any]]], fault: heldout_faults.Fault,
    heldout_set: heldout_faults.HeldoutSet = heldout_faults.SETS[1],
) -> list[dict[str, Any]]:
    """The healthy steps the monitor sees before ``fault`` (module docstring): the first
    ``HEALTHY_STEPS`` of the same sampler dtype's healthy engine, none before a template change."""
    if fault.cause == "template":
        return []
    return data[healthy_engine(heldout_set, fault.sampler_dtype).name][:HEALTHY_STEPS]


def truth_row(fault: heldout_faults.Fault, truth: str) -> str:
    """The confusion table's row for a held-out step whose true cause is ``truth``: a stale prefix
    cache's stale steps are ``PREFIX_CACHE`` (module docstring)."""
    return PREFIX_CACHE if fault.stale_prefix and truth == "stale" else truth


def after_steps(step: dict[str, Any], count: int) -> dict[str, Any]:
    """``step`` replayed ``count`` optimizer steps later: its datums' policy versions move with it,
    so each keeps its lag behind the trainer (the healthy prefix must not make every datum stale)."""
    if count == 0 or "policy_version" not in step:
        return step
    return {**step, "policy_version": step["policy_version"] + count}


BASE_INPUTS = {"guard_rail", "calibration"}
"""``step_report``'s options before direct evidence and per-lag numbers: not worth listing."""


def accepted(truth: str, table: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    return table.get(truth, (truth,))


def tuning_counts(
    base_steps: int, steps: int, skip: int, seeds: list[int], faults: dict[str, tuple[str, dict[str, Any]]]
) -> tuple[dict[str, collections.Counter[str]], dict[str, collections.Counter[str]], dict[str, list[dict[str, float]]]]:
    """The tuning generator's counts: by true cause, by fault setting, and each step's signatures by fault."""
    base = train_base(base_steps, seed=12345)
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    per_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    by_fault: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    for name, (cause, options) in faults.items():
        for seed in seeds:
            for named, signatures, fresh in run_fault(base, options, steps + skip, seed, skip)[skip:]:
                truth = "none" if fresh and cause == "stale" else cause  # just synced: no mismatch
                table[truth][named] += 1
                per_fault[name][named] += 1
                by_fault[name].append(signatures)
    return table, per_fault, by_fault


class ReplayModule(pl.LightningModule):
    """Replays one held-out fault's cached steps through the monitor: each batch is one step's
    tensors, ``training_step`` returns the trainer's logprobs. ``policy`` is the trainer's model
    (the set's GPT-2 with the fault's dropout p, in train mode on the steps whose trainer had
    dropout on), so whatever the monitor reads from the module sees what it would have seen."""

    def __init__(
        self, steps: list[dict[str, Any]], heldout_set: heldout_faults.HeldoutSet, fault: heldout_faults.Fault
    ) -> None:
        super().__init__()
        self.steps = steps
        self.policy = heldout_faults.new_model(heldout_set, dropout=fault.dropout)
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.steps, batch_size=None, shuffle=False)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        self.policy.train(bool(batch["trainer_training"]))
        return {"loss": self.anchor * 0.0, "training_logprobs": batch["training_logprobs"]}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.anchor], lr=0.0)


def quick_faults(heldout_set: heldout_faults.HeldoutSet) -> tuple[heldout_faults.Fault, ...]:
    """``--quick``'s faults of ``heldout_set``: its healthy engines and its first fault of each true
    cause, a stale prefix cache apart (a row of its own), in the set's order."""
    engines = {healthy_engine(heldout_set, f.sampler_dtype) for f in heldout_set.faults if f.cause != "template"}
    first: dict[tuple[str, bool], heldout_faults.Fault] = {}
    for fault in heldout_set.faults:
        first.setdefault((fault.cause, fault.stale_prefix > 0), fault)
    return tuple(f for f in heldout_set.faults if f in engines or f in first.values())


def heldout_counts(
    heldout_set: heldout_faults.HeldoutSet, steps: int, batch: int, pretrain_steps: int, cache_dir: str | None,
    faults: tuple[heldout_faults.Fault, ...] | None = None,
) -> tuple[dict[str, collections.Counter[str]], dict[str, collections.Counter[str]], set[str]]:
    """One held-out set's counts (of ``faults``, default: all of the set's), by true cause
    (``truth_row``) and by variant and fault setting, and the inputs the monitor gave ``step_report``
    that were set on some step (``Recorder.inputs``)."""
    faults = heldout_set.faults if faults is None else faults
    inputs: set[str] = set()
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    per_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for variant in heldout_faults.VARIANTS:
        data = heldout_faults.cached_fault_steps(
            heldout_set, variant, steps=steps, batch=batch, pretrain_steps=pretrain_steps, cache_dir=cache_dir,
            faults=faults,
        )
        for fault in faults:
            monitor = KLSampleTrainMonitor(
                media=MediaOptions(log_histogram=False, log_worst_tokens=False), log_every_n_steps=1)
            # a healthy engine calibrates on its own first steps, which are then not counted (they were seen)
            own = fault.cause != "template" and healthy_engine(heldout_set, fault.sampler_dtype) == fault
            prefix = [] if own else healthy_prefix(data, fault, heldout_set)
            uncounted = HEALTHY_STEPS if own else len(prefix)
            replayed = [*prefix, *(after_steps(step, len(prefix)) for step in data[fault.name])]
            with Recorder() as recorder:
                _trainer(len(replayed), [monitor]).fit(ReplayModule(replayed, heldout_set, fault))
            truths = [truth_row(fault, step["truth"]) for step in data[fault.name]]
            if len(recorder.steps) != len(replayed):
                raise RuntimeError(
                    f"{variant}: {fault.name}: {len(replayed)} steps replayed, {len(recorder.steps)} diagnosed"
                )
            inputs |= recorder.inputs
            for (named, _, _), truth in zip(recorder.steps[uncounted:], truths[uncounted - len(prefix):]):
                table[truth][named] += 1
                per_fault[f"{variant}: {fault.name}"][named] += 1
    return table, per_fault, inputs


def print_confusion(
    table: dict[str, collections.Counter[str]], right: dict[str, tuple[str, ...]], truths: list[str], label: str
) -> None:
    """Rows: true causes (recall: share named a right cause); then each named cause's precision."""
    shown = list(CAUSES) + sorted({c for row in table.values() for c in row} - set(CAUSES))
    print(f"| {label} | " + " | ".join(shown) + " | right |")
    print("|---|" + "---|" * (len(shown) + 1))
    for truth in [*truths, *sorted(set(table) - set(truths))]:
        if truth not in table:
            continue
        row = table[truth]
        good = sum(row[c] for c in accepted(truth, right))
        print(f"| {truth} | " + " | ".join(str(row[c]) for c in shown) + f" | {good / sum(row.values()):.0%} |")
    named_total = named_right = 0
    parts = []
    for cause in shown:
        total = sum(row[cause] for row in table.values())
        if not total or cause == "unclear":
            continue
        good = sum(row[cause] for truth, row in table.items() if cause in accepted(truth, right))
        named_total, named_right = named_total + total, named_right + good
        parts.append(f"{cause} {good}/{total} ({good / total:.0%})")
    print("\nPrecision when a cause is named (right / named): " + ", ".join(parts))
    if named_total:
        unclear, steps = sum(row["unclear"] for row in table.values()), sum(sum(r.values()) for r in table.values())
        print(f"All named causes (not unclear): {named_right}/{named_total} ({named_right / named_total:.0%}) right; "
              f"unclear on {unclear} of {steps} steps")


def print_per_fault(per_fault: dict[str, collections.Counter[str]]) -> None:
    print("\nPer fault setting (named cause: steps):")
    for name, counts in per_fault.items():
        print(f"  {name}: " + ", ".join(f"{cause} {count}" for cause, count in counts.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-steps", type=int, default=150)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=HEALTHY_STEPS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--signatures", action="store_true")
    parser.add_argument("--other", action="store_true", help="the other fault settings (OTHER_FAULTS)")
    parser.add_argument("--tables", action="store_true", help="the tuning table, then each held-out set's table")
    parser.add_argument("--heldout-sets", type=int, nargs="+", choices=sorted(heldout_faults.SETS),
                        default=sorted(heldout_faults.SETS), help="with --tables: the held-out sets (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings and, with --tables, one fault of each kind per set (a smoke run)")
    parser.add_argument("--heldout-steps", type=int, default=None,
                        help="monitor steps per held-out fault (default: the set's monitor_steps)")
    parser.add_argument("--heldout-batch", type=int, default=128, help="sequences per held-out monitor step")
    parser.add_argument("--heldout-pretrain", type=int, default=300, help="steps of the held-out checkpoint")
    parser.add_argument("--cache-dir", default=None, help="where the held-out steps are cached (default: temp dir)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if args.quick:
        args.base_steps, args.steps, args.skip, args.seeds = 2, 2, 0, [0]
        args.heldout_steps, args.heldout_batch, args.heldout_pretrain = 2, 2, 1
    faults = OTHER_FAULTS if args.other else FAULTS
    print(f"CPU: {cpu_name()}")
    table, per_fault, by_fault = tuning_counts(args.base_steps, args.steps, args.skip, args.seeds, faults)
    print(f"Tuning set: the RL demo, base policy {args.base_steps} fault-free steps; per fault {len(args.seeds)} "
          f"seed(s) x {args.steps} monitor steps (seeds {args.seeds}).\n")
    print_confusion(table, ACCEPTED, [*CAUSES, "template, slight"], "seeded cause")
    print_per_fault(per_fault)
    if args.signatures:
        print("\nMean signature per fault (median over steps):")
        print("| fault | " + " | ".join(SIGNATURES) + " |")
        for name, rows in by_fault.items():
            medians = [np.nanmedian([r[s] for r in rows]) for s in SIGNATURES]
            print(f"| {name} | " + " | ".join(f"{m:.3g}" for m in medians) + " |")
    if not args.tables:
        return
    for number in args.heldout_sets:
        print_heldout_set(number, args.heldout_steps, args.heldout_batch, args.heldout_pretrain, args.cache_dir,
                          args.quick)


def print_heldout_set(
    number: int, steps: int | None, batch: int, pretrain_steps: int, cache_dir: str | None, quick: bool = False
) -> None:
    """Held-out set ``number``'s heading, confusion table and per-fault lines (``steps`` ``None``:
    the set's ``monitor_steps``; ``quick``: of ``quick_faults`` only)."""
    heldout_set = heldout_faults.SETS[number]
    steps = heldout_set.monitor_steps if steps is None else steps
    faults = quick_faults(heldout_set) if quick else None
    table, per_fault, inputs = heldout_counts(heldout_set, steps, batch, pretrain_steps, cache_dir, faults)
    print(f"\nHeld-out set {number}, {HELDOUT_LABELS.get(number, 'held out')}: benchmarks/heldout_faults.py "
          f"SETS[{number}] \"{heldout_set.name}\": {heldout_set.summary()}; {pretrain_steps} checkpoint steps; per "
          f"fault and variant {steps} monitor steps of {batch} sequences. The monitor gave step_report: "
          f"{', '.join(sorted(inputs - BASE_INPUTS)) or 'nothing'} besides the statistics and options.\n")
    truths = [c for cause in CAUSES for c in ((cause, PREFIX_CACHE) if cause == "stale" else (cause,))]
    truths += [c for c in ("template", "dropout") if c not in CAUSES]
    print_confusion(table, HELDOUT_ACCEPTED, truths, "true cause")
    print_per_fault(per_fault)


if __name__ == "__main__":
    main()
