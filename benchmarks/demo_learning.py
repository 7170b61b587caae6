"""How fast the demo models learn: RL reward and DPO accuracy before/after, with wall and CPU times.

Runs the demo modules through ``lightning.Trainer`` the way the shipped experiments do:

1. RL: ``RLPolicyModule`` on ``ReverseDigitsTask`` (random init), mean reward of sampled
   completions on held-out prompts before and after ``--rl-steps`` optimizer steps.
2. DPO: ``DPOPolicyModule`` on toy preference pairs (chosen = the correct completion, rejected =
   one digit changed), reference logprobs from a frozen copy of its initial weights attached with
   ``attach_reference_logprobs``; accuracy (share of pairs with a positive margin) and mean margin
   on held-out pairs before and after ``--dpo-steps`` steps (before, policy = reference: margin 0).
3. With ``--variants``: the RL run again with a bfloat16 sampler, a sampler synced every 8
   steps, and a sampler that is never synced, with the mean |trainer - sampler| logprob gap.

Setup and use (from the repository root)::

    pip install torch==2.13.0 -e ".[dev]"
    python benchmarks/demo_learning.py
    python benchmarks/demo_learning.py --threads 2 --variants

The times are of training alone (no start-up, no loggers); ``benchmarks/bench_demo.py`` times the
shipped configs through the ``loops-callbacks`` command, start-up included.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import lightning
import torch
from torch.utils.data import DataLoader

from loops_callbacks.data import DPOPairDataset, collate_dpo_pairs, dpo_pair_datums
from loops_callbacks.demo.data import PromptDataModule, make_preference_pairs
from loops_callbacks.demo.dpo import DPOPolicyModule, dpo_loss
from loops_callbacks.demo.rl import RLPolicyModule
from loops_callbacks.demo.tasks import ReverseDigitsTask
from loops_callbacks.reference import TorchSamplingClient, attach_reference_logprobs


def _trainer(max_steps: int, callbacks: list[lightning.Callback] | None = None) -> lightning.Trainer:
    return lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


class _GapMeter(lightning.Callback):
    """Mean |trainer - sampler| logprob over the action tokens of the whole run."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        active = outputs["mask"] > 0
        gap = (outputs["training_logprobs"].detach() - outputs["logprobs"])[active]
        self.total += gap.abs().sum().item()
        self.count += gap.numel()

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


def _mean_reward(module: RLPolicyModule, prompts: torch.Tensor) -> float:
    """Mean reward of completions sampled from the current policy (copied into the sampler)."""
    module.sync_sampler()
    completions = module.sample(prompts)
    rewards = [module.task.reward(p, c) for p, c in zip(prompts.tolist(), completions.tolist())]
    return sum(rewards) / len(rewards)


def run_rl(args: argparse.Namespace, **overrides: Any) -> dict[str, float]:
    lightning.seed_everything(args.seed, verbose=False)
    settings = dict(num_digits=args.num_digits, num_symbols=args.num_symbols, group_size=args.group_size)
    module = RLPolicyModule(**settings, **overrides)
    held_out = module.task.sample_prompts(256, torch.Generator().manual_seed(10_000 + args.seed))
    before = _mean_reward(module, held_out)
    gap = _GapMeter()
    start, cpu_start = time.perf_counter(), time.process_time()
    _trainer(args.rl_steps, [gap]).fit(
        module,
        PromptDataModule(args.num_digits, args.num_symbols, batch_size=args.prompts_per_batch, seed=args.seed),
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"before": before, "after": _mean_reward(module, held_out), "seconds": seconds, "cpu": cpu, "gap": gap.mean}


def run_dpo(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    task = ReverseDigitsTask(args.num_digits, args.num_symbols)
    module = DPOPolicyModule(max_seq_len=task.prompt_length + task.max_new_tokens, beta=args.beta)
    reference = TorchSamplingClient.snapshot(module)  # a frozen copy of the initial policy

    def scored(pairs: list) -> DPOPairDataset:
        datums = [datum for chosen, rejected, k in pairs for datum in dpo_pair_datums(chosen, rejected, k)]
        return DPOPairDataset(attach_reference_logprobs(datums, reference))

    held_out = collate_dpo_pairs(list(scored(make_preference_pairs(task, 512, seed=10_000 + args.seed))))

    def held_out_metrics() -> dict[str, float]:
        with torch.no_grad():
            policy = module.policy_logprobs(held_out)
            _, metrics = dpo_loss(policy, held_out["ref_logprobs"], held_out["weights"], module.beta)
        return {name: value.item() for name, value in metrics.items()}

    train_pairs = scored(make_preference_pairs(task, args.dpo_pairs, seed=args.seed))
    train = DataLoader(train_pairs, batch_size=32, shuffle=True, collate_fn=collate_dpo_pairs)
    before = held_out_metrics()
    start, cpu_start = time.perf_counter(), time.process_time()
    _trainer(args.dpo_steps).fit(module, train)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = held_out_metrics()
    return {
        "before": before["dpo_accuracy"],
        "after": after["dpo_accuracy"],
        "margin_before": before["dpo_margin"],
        "margin_after": after["dpo_margin"],
        "seconds": seconds,
        "cpu": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-digits", type=int, default=4)
    parser.add_argument("--num-symbols", type=int, default=10)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-batch", type=int, default=16)
    parser.add_argument("--rl-steps", type=int, default=400)
    parser.add_argument("--dpo-steps", type=int, default=150)
    parser.add_argument("--dpo-pairs", type=int, default=1024)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--variants", action="store_true", help="also run the sampler-gap variants")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")

    print(
        f"threads={args.threads} seed={args.seed} task=ReverseDigitsTask(num_digits={args.num_digits}, "
        f"num_symbols={args.num_symbols}) group_size={args.group_size} prompts/batch={args.prompts_per_batch}"
    )
    rl = run_rl(args)
    print(
        f"RL   {args.rl_steps} steps: reward {rl['before']:.3f} -> {rl['after']:.3f} "
        f"in {rl['seconds']:.1f} s wall, {rl['cpu']:.1f} s CPU (mean |trainer - sampler| {rl['gap']:.2e})"
    )
    dpo = run_dpo(args)
    print(
        f"DPO  {args.dpo_steps} steps (beta={args.beta}, {args.dpo_pairs} pairs): held-out accuracy "
        f"{dpo['before']:.3f} -> {dpo['after']:.3f}, margin {dpo['margin_before']:.3f} -> {dpo['margin_after']:.3f} "
        f"in {dpo['seconds']:.1f} s wall, {dpo['cpu']:.1f} s CPU"
    )
    if args.variants:
        for label, overrides in (
            ("bfloat16 sampler, sync_every=1", {"sampler_precision": "bfloat16"}),
            ("float32 sampler, sync_every=8", {"sync_every": 8}),
            ("float32 sampler, never synced", {"sync_every": None}),
        ):
            result = run_rl(args, **overrides)
            print(
                f"RL   {label:32s}: reward {result['before']:.3f} -> {result['after']:.3f} "
                f"in {result['seconds']:.1f} s wall, {result['cpu']:.1f} s CPU "
                f"(mean |trainer - sampler| {result['gap']:.2e})"
            )


if __name__ == "__main__":
    main()
