"""Per-step cost of KLSampleTrainMonitor on a small training run, with and without it.

The same run (a tiny causal LM, padded [B, T] batches, CPU) is trained with no monitor and with
the monitor (histogram and table on, Lightning's default interval of 50 steps), alternating the
two several times in one process. It prints:

* the wall-time ratio of whole runs (noisy at the 1% level on a shared machine);
* the time spent inside the monitor's hook, measured directly, per logged and per not-logged
  step, as a fraction of the median step time (precise);
* the same with every option on side by side (``--all-on``: every stratum, the batch carrying a
  policy version and a group per row, and three corrections shadowed), and one line per stratum
  family and per correction: the median time ``DivergenceStats.from_batch`` spends on it for one
  step's batch (with it on minus without), as a share of the median step.

    python benchmarks/bench_callback.py               # 300 steps x 3 repeats
    python benchmarks/bench_callback.py --quick       # 60 steps x 1 repeat
    python benchmarks/bench_callback.py --all-on      # and the monitor with everything on, and each part's cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.demo.model import TinyCausalLM  # noqa: E402

VOCAB, LENGTH, BATCH = 64, 64, 16
CORRECTIONS = ("sequence_mask:3.0", "token_truncate:2.0", "geo:0.999_1.001")
"""TRL's default mode, verl's token TIS cap and DeepSeek-V3.2's geometric-mean rejection."""


class RandomTokens(Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, VOCAB, (LENGTH + 1,), generator=generator)
        return {
            "input_ids": tokens[:-1],
            "target_tokens": tokens[1:],
            "mask": (torch.arange(LENGTH) >= 8).float(),
            "noise": 0.05 * torch.randn(LENGTH, generator=generator),
        }


class Policy(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyCausalLM(VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=LENGTH)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        logprobs = torch.log_softmax(self.model(batch["input_ids"]), -1)
        logprobs = logprobs.gather(-1, batch["target_tokens"][..., None]).squeeze(-1)
        loss = -(logprobs * batch["mask"]).sum() / batch["mask"].sum()
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        rows = torch.arange(batch["input_ids"].shape[0])
        return {
            "loss": loss,
            "training_logprobs": logprobs,
            "logprobs": logprobs.detach() + batch["noise"],
            "policy_version": (step - rows % 3).clamp(min=0),  # read by the monitor only when it logs
            "group": rows % 4,
        }

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomTokens(), batch_size=BATCH)


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


class TimedMonitor(KLSampleTrainMonitor):
    """The monitor, with the time spent in its hook recorded per step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_seconds: list[tuple[bool, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        logged = self._logs_at(trainer, trainer.fit_loop.epoch_loop._batches_that_stepped)
        start = time.perf_counter()
        super().on_train_batch_end(trainer, *args)
        self.hook_seconds.append((logged, time.perf_counter() - start))


class NullLogger(pl.loggers.logger.Logger):
    """Accepts everything (W&B media included) and writes nothing: the logger's own I/O is not ours."""

    name, version = "null", 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        pass


def run(steps: int, monitor: KLSampleTrainMonitor | None, accelerator: str = "cpu") -> tuple[float, list[float]]:
    torch.manual_seed(0)
    timer = StepTimes()
    callbacks: list[pl.Callback] = [timer] + ([monitor] if monitor else [])
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, max_steps=steps, logger=NullLogger(), callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(Policy())
    total = time.perf_counter() - start
    return total, [b - a for a, b in zip(timer.starts, timer.starts[1:])]


def part_costs(repeats: int = 60) -> list[tuple[str, float]]:
    """Seconds ``from_batch`` spends on each stratum family and each correction, for one step's batch.

    Every configuration is timed once per round, round after round, and each takes its median:
    a load that changes during the measurement moves them all alike.
    """
    import dataclasses

    from loops_callbacks.divergence.batch import flatten_padded
    from loops_callbacks.divergence.statistics import parse_corrections
    from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions

    items = [RandomTokens()[i] for i in range(BATCH)]
    batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    trainer = -torch.rand(BATCH, LENGTH, generator=torch.Generator().manual_seed(0)) * 4
    flat = flatten_padded(sampler_logprobs=trainer + batch["noise"], training_logprobs=trainer, mask=batch["mask"],
                          target_tokens=batch["target_tokens"], input_ids=batch["input_ids"], with_tokens=True)
    rows = torch.arange(BATCH)
    versioned = dataclasses.replace(flat, lags=rows % 3)
    grouped = dataclasses.replace(versioned, groups=rows % 4)

    shared: dict[str, Any] = {"top_n": 20, "sample_size": 100_000}
    configurations: dict[str, tuple[Any, StatisticsOptions]] = {
        "base": (flat, StatisticsOptions(**shared)),
        "no diagnosis": (flat, StatisticsOptions(**shared, diagnose=False)),
        "p, pos": (flat, StatisticsOptions(**shared, max_groups=8)),
        "p, pos, lag": (versioned, StatisticsOptions(**shared, max_groups=8)),
        "all strata": (grouped, StatisticsOptions(**shared, max_groups=8)),
        **{c.name: (flat, StatisticsOptions(**shared, corrections=(c,))) for c in parse_corrections(CORRECTIONS)},
    }
    times: dict[str, list[float]] = {name: [] for name in configurations}
    for _ in range(repeats):
        for name, (batch_flat, options) in configurations.items():
            start = time.perf_counter()
            DivergenceStats.from_batch(batch_flat, options)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    base = median["base"]
    costs = [
        ("statistics without strata or corrections", base),
        ("  of which the diagnosis (signatures, offset votes)", base - median["no diagnosis"]),
        ("strata: sampler probability and quartile", median["p, pos"] - base),
        ("strata: policy lag", median["p, pos, lag"] - median["p, pos"]),
        ("strata: group", median["all strata"] - median["p, pos, lag"]),
    ]
    for correction in parse_corrections(CORRECTIONS):
        costs.append((f"correction {correction.name}", median[correction.name] - base))
    return costs


def hook_lines(label: str, hooks: list[tuple[bool, float]], median_step: float) -> None:
    logged = [s for is_logged, s in hooks if is_logged]
    not_logged = [s for is_logged, s in hooks if not is_logged]
    per_step_mean = sum(s for _, s in hooks) / len(hooks)
    print(f"{label}: hook on logged steps ({len(logged)}): median {statistics.median(logged) * 1e3:.2f} ms, "
          f"slowest {max(logged) * 1e3:.2f} ms")
    print(f"{label}: hook on other steps ({len(not_logged)}): median {statistics.median(not_logged) * 1e6:.1f} us "
          f"= {statistics.median(not_logged) / median_step:.4%} of a step (target <= 1%)")
    print(f"{label}: hook averaged over all steps at the default interval: {per_step_mean * 1e3:.3f} ms "
          f"= {per_step_mean / median_step:.2%} of a step (target <= 3%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--accelerator", default="cpu", help="cpu or gpu")
    parser.add_argument(
        "--all-on", action="store_true", help="also every stratum and three corrections, and each part's cost"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 60, 1
    warnings.filterwarnings("ignore")
    run(20, None, args.accelerator)  # warm-up: imports, allocator

    plain_runs, monitored_runs, step_times, hooks, all_on_hooks = [], [], [], [], []
    for _ in range(args.repeats):
        plain_total, plain_steps = run(args.steps, None, args.accelerator)
        monitor = TimedMonitor()
        monitored_total, _ = run(args.steps, monitor, args.accelerator)
        plain_runs.append(plain_total)
        monitored_runs.append(monitored_total)
        step_times += plain_steps
        hooks += monitor.hook_seconds
        if args.all_on:
            all_on = TimedMonitor(corrections=list(CORRECTIONS))
            run(args.steps, all_on, args.accelerator)
            all_on_hooks += all_on.hook_seconds

    median_step = statistics.median(step_times)
    print(f"{args.accelerator}: {args.steps} steps x {args.repeats} repeats, batch {BATCH} x {LENGTH} tokens, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median step {median_step * 1e3:.2f} ms")
    print(f"whole runs: without monitor {statistics.median(plain_runs):.2f} s, "
          f"with {statistics.median(monitored_runs):.2f} s, "
          f"ratio {statistics.median(monitored_runs) / statistics.median(plain_runs):.3f} (noisy at the 1% level)")
    hook_lines("monitor (defaults)", hooks, median_step)
    if args.all_on:
        hook_lines(f"monitor + {len(CORRECTIONS)} corrections", all_on_hooks, median_step)
        for name, seconds in part_costs():
            print(f"  {name:<48} {seconds * 1e3:7.3f} ms = {seconds / median_step:6.2%} of a step (on a logged step)")


if __name__ == "__main__":
    main()
