"""Does a rollout correction help the stale-sampler demo? Reward and k3 with and without one, over seeds.

Runs ``RLPolicyModule`` (the ``rl_stale_sampler`` experiment: a sampler that never receives the
trainer's weights, ``sync_every=None``, and one synced only every ``--lags`` steps) for ``--steps``
optimizer steps per seed, once with Loops' unclipped importance ratio and once per ``--corrections`` spec applied in the loss
(``RLPolicyModule(correction=...)``), plus the healthy run (sampler synced every step) for scale.
``KLSampleTrainMonitor`` watches every run without acting (``max_kl=None``), so the runs go on
where the shipped config stops, and it logs, for each listed correction, what it would do
(``corrections=``) when the monitor supports it.

The sampled completions' reward says nothing about the policy while the sampler is stale (it
samples from old weights), so the policy's own reward is measured every ``--eval-every`` steps on
fixed held-out prompts, from a synced copy (the run is untouched). Prints, per variant, that
reward (mean ± spread over seeds) and the monitor's ``kl_sample_train_k3`` over the last steps,
and writes the per-step curves as CSV (``--out``).

    python benchmarks/bench_correction_demo.py                                    # 3 seeds x 300 steps
    python benchmarks/bench_correction_demo.py --seeds 0 --steps 40 --eval-every 20  # quick look
"""

from __future__ import annotations

import argparse
import copy
import csv
import inspect
import logging
import os
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(__file__))

from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.divergence.monitor import MediaOptions  # noqa: E402
from loops_callbacks.demo import PromptDataModule, RLPolicyModule  # noqa: E402
from machine import cpu_name  # noqa: E402

K3 = "optim/train-sample-div/kl_sample_train_k3"


def policy_reward(module: RLPolicyModule, prompts: torch.Tensor) -> float:
    """Mean reward of completions sampled from the trainer's policy itself (a synced copy; the run is untouched).

    With a stale sampler the sampled completions' reward (``train/reward``) says nothing about the
    policy being trained: this is what it has learned.
    """
    evaluated = copy.deepcopy(module)
    evaluated.sync_sampler()
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        completions = evaluated.sample(prompts)
    rewards = [module.task.reward(p, c) for p, c in zip(prompts.tolist(), completions.tolist())]
    return sum(rewards) / len(rewards)


class _Curves(pl.Callback):
    """The sampled reward and k3 of every optimizer step, the policy's own reward every ``eval_every``."""

    def __init__(self, prompts: torch.Tensor, eval_every: int) -> None:
        self.prompts, self.eval_every = prompts, eval_every
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = trainer.callback_metrics
        step = trainer.global_step - 1
        evaluate = (step + 1) % self.eval_every == 0
        self.rows.append(
            {
                "step": step,
                "sampled_reward": float(metrics["train/reward"]),
                "policy_reward": policy_reward(pl_module, self.prompts) if evaluate else float("nan"),
                "k3": float(metrics[K3]) if K3 in metrics else float("nan"),
            }
        )


def run(
    seed: int, steps: int, sync_every: int | None, correction: str | None, shadow: list[str], eval_every: int
) -> list[dict]:
    pl.seed_everything(seed, verbose=False)
    module = RLPolicyModule(num_digits=4, group_size=8, lr=1e-3, sync_every=sync_every, correction=correction)
    with torch.random.fork_rng():
        torch.manual_seed(10_000)  # the same held-out prompts for every run
        prompts = module.task.sample_prompts(128)
    curves = _Curves(prompts, eval_every)
    options: dict[str, Any] = {"media": MediaOptions(log_histogram=False, log_worst_tokens=False)}
    if shadow and "corrections" in inspect.signature(KLSampleTrainMonitor).parameters:
        options["corrections"] = shadow
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[KLSampleTrainMonitor(**options), curves],
    )
    trainer.fit(module, PromptDataModule(num_digits=4, batch_size=16))
    return curves.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--corrections", nargs="+", default=["token_truncate:2.0", "sequence_mask:3.0"])
    parser.add_argument(
        "--lags", nargs="+", default=["never", "16"], help="how stale the sampler is: 'never' synced, or sync_every"
    )
    parser.add_argument("--eval-every", type=int, default=50, help="the policy's own reward every this many steps")
    parser.add_argument("--out", default=None, help="CSV of every step's numbers (default: not written)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    variants: list[tuple[str, int | None, str | None]] = [("synced every step", 1, None)]
    for lag in args.lags:
        sync_every = None if lag == "never" else int(lag)
        where = "never synced" if sync_every is None else f"synced every {sync_every} steps"
        variants.append((f"{where}, Loops' ratio", sync_every, None))
        variants += [(f"{where}, {spec}", sync_every, spec) for spec in args.corrections]
    print(f"{cpu_name()}, torch {torch.__version__}; seeds {args.seeds}, {args.steps} steps")
    evals = list(range(args.eval_every - 1, args.steps, args.eval_every))
    header = " | ".join(f"step {step + 1}" for step in evals)
    print(f"\n| sampler, loss | policy reward at {header} | k3, last {args.eval_every} steps | s per run |")
    print("|---|" + "---|" * (len(evals) + 2))
    all_rows = []
    for name, sync_every, correction in variants:
        policy, k3s, seconds = [], [], []
        for seed in args.seeds:
            start = time.perf_counter()
            rows = run(seed, args.steps, sync_every, correction, args.corrections, args.eval_every)
            seconds.append(time.perf_counter() - start)
            policy.append([rows[step]["policy_reward"] for step in evals])
            k3s.append(np.nanmean([row["k3"] for row in rows[-args.eval_every :]]))
            all_rows += [{"variant": name, "seed": seed, **row} for row in rows]
        policy_reward, k3 = np.array(policy), np.array(k3s)
        cells = [f"{policy_reward[:, i].mean():.2f} ± {policy_reward[:, i].std():.2f}" for i in range(len(evals))]
        print(f"| {name} | {' | '.join(cells)} | {k3.mean():.3g} ± {k3.std():.2g} | {np.mean(seconds):.0f} |")
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(all_rows[0]))
            writer.writeheader()
            writer.writerows(all_rows)
        print(f"\ncurves: {args.out}")
    print(
        "\n(policy reward: mean reward of completions sampled from the trainer's policy on 128 fixed held-out "
        "prompts, mean ± standard deviation over seeds; k3 = kl_sample_train_k3)"
    )


if __name__ == "__main__":
    main()
