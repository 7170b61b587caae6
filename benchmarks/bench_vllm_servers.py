"""A fleet of vLLM servers (``VLLMServerFleet``): a weight sync's time by phase, and rollout throughput with one
server and with two.

Starts two vLLM servers on this machine on the checkpoint (``LocalVLLMServers``, float32, dev mode), or
uses ``--servers`` already running on it. Then:

* ``--syncs`` syncs of the checkpoint's weights (moved a little each time) to both servers at once
  (path transport, prefix-cache reset): per phase, the median over the syncs of the slowest server,
  the trainer's write of the safetensors, and the whole sync;
* rollouts: ``--prompts`` prompts of 16 random tokens, ``--n`` completions of ``--max-tokens`` tokens
  each (no stop token: every completion is ``--max-tokens`` long), from the first server alone, then
  from both; best of ``--repeats`` (tokens sampled per second of wall time);
* the monitor's overhead on a fleet step (``--overhead-steps``, 0: not measured): a GRPO-style Lightning
  fit on the same servers whose every step syncs the policy to both servers, samples ``--overhead-prompts``
  prompts x ``--n`` completions of ``--max-tokens`` tokens from them, and runs the trainer's forward and
  backward; the ``KLSampleTrainMonitor`` (logging every step) runs on every other step (A/B/A/B, the first
  pair a warm-up). Printed: the median step with and without it, and the median over the monitored steps of
  (the monitor's hook time / that step's time).

    python benchmarks/bench_vllm_servers.py --model tiny                     # the tests' tiny Llama
    python benchmarks/bench_vllm_servers.py --model smollm2 --cache-dir /tmp/rm_cache   # SmolLM2-135M, float32
    python benchmarks/bench_vllm_servers.py --model tiny --syncs 2 --prompts 4 --max-tokens 4 --repeats 1 \
        --overhead-steps 4 --overhead-prompts 2  # smoke

On a machine with as many cores as servers want, two servers sample about twice as fast as one; on a
2-core machine they share the cores. Needs vLLM; run with OMP_NUM_THREADS=1. Writes only in a
temporary directory (and ``--cache-dir``, the checkpoint's).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(__file__))

from bench_callback import NullLogger  # noqa: E402
from machine import cpu_name  # noqa: E402

from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.demo.rl import policy_gradient_loss  # noqa: E402
from loops_callbacks.integrations.vllm import LocalVLLMServers, VLLMServerFleet  # noqa: E402
from loops_callbacks.integrations.vllm.fleet import SYNC_PHASES  # noqa: E402
from loops_callbacks.logprobs import token_logprobs  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct-f32"


def tiny_llama(directory: Path) -> Path:
    """The tests' tiny Llama (hidden 128, 2 layers, 512-token word-level vocabulary), built from a config."""
    import tokenizers
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t2"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t0", eos_token="t1",
                                         unk_token="t2").save_pretrained(directory)
    return directory


def measure(urls: Sequence[str], model: Any, *, syncs: int, prompts: int, n: int, max_tokens: int, repeats: int,
            weights_dir: str, vocab: int) -> dict[str, Any]:
    """The figures on running servers ``urls`` (two or more) serving ``model``'s checkpoint."""
    fleet = VLLMServerFleet(list(urls[:2]), weights_dir=weights_dir)
    trainer = copy.deepcopy(model)
    reports = []
    generator = torch.Generator().manual_seed(0)
    for version in range(1, syncs + 1):
        with torch.no_grad():
            for parameter in trainer.parameters():
                parameter.add_(1e-3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
        fleet.push(trainer, version=version)
        reports.append(fleet.last_sync)
    phases = {phase: statistics.median(r.slowest()[phase] for r in reports) for phase in SYNC_PHASES}
    phases["write"] = statistics.median(r.write_seconds for r in reports)
    phases["whole sync"] = statistics.median(r.seconds for r in reports)
    ids = torch.randint(3, vocab, (prompts, 16), generator=generator).tolist()
    throughput = {}
    for count in (1, 2):
        sub = VLLMServerFleet(list(urls[:count]), weights_dir=weights_dir, prompts_per_request=max(1, prompts // 4))
        sub.push(trainer, version=syncs + 1)
        best = 0.0
        for _ in range(repeats):
            began = time.perf_counter()
            batch = sub.rollouts(ids, max_tokens=max_tokens, n=n, ignore_eos=True)
            seconds = time.perf_counter() - began
            best = max(best, float(batch["mask"].sum()) / seconds)
        throughput[count] = best
        sub.close()
    fleet.close()
    return {"phases": phases, "throughput": throughput, "syncs": syncs}


class RandomPrompts(Dataset):
    """Prompts of 16 random token ids (no BOS, no stop), the same for a given index."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (16,), generator=torch.Generator().manual_seed(index))


class FleetStep(pl.LightningModule):
    """A GRPO-style step sampled by a fleet: sync the policy to every server (``on_train_batch_start``), ``n``
    completions per prompt from them, the trainer's forward and backward of an importance-sampling loss whose
    reward is the share of even token ids in a completion (advantage: minus the group's mean)."""

    def __init__(self, model: Any, fleet: VLLMServerFleet, *, prompts: int, n: int, max_tokens: int) -> None:
        super().__init__()
        self.policy, self.fleet = model, fleet
        self.prompts, self.n, self.max_tokens = prompts, n, max_tokens

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.fleet.push(self.policy, version=self.trainer.global_step)  # the optimizer steps the weights had

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        rollouts = self.fleet.rollouts(batch.tolist(), max_tokens=self.max_tokens, n=self.n, ignore_eos=True,
                                       device=self.device)
        mask, targets = rollouts["mask"], rollouts["target_tokens"]
        rewards = ((targets % 2 == 0).float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        grouped = rewards.view(-1, self.n)
        advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
        training_logprobs = token_logprobs(self.policy(rollouts["input_ids"]).logits, targets)
        loss = policy_gradient_loss(training_logprobs, rollouts["logprobs"], mask, advantages)
        return {**rollouts, "loss": loss, "training_logprobs": training_logprobs, "advantages": advantages}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomPrompts(self.policy.config.vocab_size), batch_size=self.prompts)


class StepStarts(pl.Callback):
    """When each step starts (before the sync: callbacks' hooks run before the module's)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


class EveryOtherStepMonitor(KLSampleTrainMonitor):
    """The monitor, logging every step it runs, on even steps only (A); odd steps (B) pass without it. Records
    the time spent in its hook per even step."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.hook_seconds: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step - 1  # the optimizer has stepped
        if step % 2:
            return
        began = time.perf_counter()
        super().on_train_batch_end(trainer, *args)
        self.hook_seconds[step] = time.perf_counter() - began


def monitor_overhead(urls: Sequence[str], model: Any, *, steps: int, prompts: int, n: int, max_tokens: int,
                     weights_dir: str, root: str) -> dict[str, Any]:
    """``steps`` fleet steps on running servers ``urls`` (two or more) serving ``model``'s checkpoint, the monitor
    on every other one; the first pair is a warm-up."""
    if steps < 4 or steps % 2:
        raise ValueError(f"steps must be even and at least 4 (a warm-up pair, then A/B pairs), not {steps}")
    fleet = VLLMServerFleet(list(urls[:2]), weights_dir=weights_dir, prompts_per_request=max(1, prompts // 2))
    torch.manual_seed(0)
    module = FleetStep(copy.deepcopy(model).train(), fleet, prompts=prompts, n=n, max_tokens=max_tokens)
    timer, monitor = StepStarts(), EveryOtherStepMonitor()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=NullLogger(), callbacks=[timer, monitor],
        log_every_n_steps=1, default_root_dir=root, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module)
    finally:
        fleet.close()
    seconds = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    if len(seconds) != steps or sorted(monitor.hook_seconds) != list(range(0, steps, 2)):
        raise RuntimeError(f"{len(seconds)} steps timed and monitored steps {sorted(monitor.hook_seconds)}, "
                           f"for {steps} steps")
    with_monitor = [seconds[step] for step in range(2, steps, 2)]
    without = [seconds[step] for step in range(3, steps, 2)]
    shares = [monitor.hook_seconds[step] / seconds[step] for step in range(2, steps, 2)]
    return {
        "pairs": len(with_monitor), "step_with": statistics.median(with_monitor),
        "step_without": statistics.median(without),
        "hook": statistics.median(monitor.hook_seconds[step] for step in range(2, steps, 2)),
        "share": statistics.median(shares), "logged": monitor.guard_rail.logged_steps,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--cache-dir", default=os.environ.get("LOOPS_CALLBACKS_CACHE", "/tmp/rm_cache"))
    parser.add_argument("--servers", nargs="*", default=None, help="two running servers on the checkpoint")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--overhead-steps", type=int, default=22, help="fleet steps, monitor on every other (0: none)")
    parser.add_argument("--overhead-prompts", type=int, default=8)
    args = parser.parse_args(argv)
    import transformers
    import vllm

    print(f"CPU: {cpu_name()}; vllm {vllm.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="bench_vllm_servers_") as work:
        if args.model == "tiny":
            checkpoint = tiny_llama(Path(work) / "tiny_llama")
            label = "tiny Llama (hidden 128, 2 layers)"
        else:
            checkpoint = Path(args.cache_dir) / SMOLLM2
            if not (checkpoint / "config.json").is_file():
                raise SystemExit(f"{checkpoint} is missing: python benchmarks/real_model.py --cache-dir {args.cache_dir}")
            label = "SmolLM2-135M-Instruct, float32"
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        print(f"model: {label}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.1f} MiB sent per sync")
        servers = None
        urls = args.servers
        if not urls:
            began = time.perf_counter()
            servers = LocalVLLMServers(checkpoint, count=2, workdir=Path(work) / "servers", start_timeout=900)
            urls = servers.start()
            print(f"two servers started in {time.perf_counter() - began:.0f} s")
        try:
            figures = measure(urls, model, syncs=args.syncs, prompts=args.prompts, n=args.n,
                              max_tokens=args.max_tokens, repeats=args.repeats,
                              weights_dir=str(Path(work) / "weights"), vocab=model.config.vocab_size)
            if args.overhead_steps:
                figures["overhead"] = monitor_overhead(
                    urls, model, steps=args.overhead_steps, prompts=args.overhead_prompts, n=args.n,
                    max_tokens=args.max_tokens, weights_dir=str(Path(work) / "overhead_weights"), root=str(Path(work) / "fit"))
        finally:
            if servers is not None:
                servers.stop()
    print_figures(figures, args)


def print_figures(figures: dict[str, Any], args: argparse.Namespace) -> None:
    """The figures as two Markdown tables."""
    print(f"\nA sync to two servers at once (median of {figures['syncs']}, the slowest server per phase):")
    print("| phase | ms |\n|---|---:|")
    for phase, seconds in figures["phases"].items():
        print(f"| {phase} | {1e3 * seconds:.1f} |")
    print(f"\nRollouts: {args.prompts} prompts x n={args.n} x {args.max_tokens} tokens (best of {args.repeats}):")
    print("| servers | tokens/s |\n|---:|---:|")
    for count, rate in figures["throughput"].items():
        print(f"| {count} | {rate:.0f} |")
    overhead = figures.get("overhead")
    if overhead is not None:
        print(f"\nThe monitor on a fleet step (sync to both servers + {args.overhead_prompts} prompts x n={args.n} x "
              f"{args.max_tokens} tokens + forward/backward), logging every step, on every other step "
              f"({overhead['pairs']} A/B pairs after a warm-up pair; {overhead['logged']} steps logged):")
        print(f"median step with the monitor {1e3 * overhead['step_with']:.1f} ms, without "
              f"{1e3 * overhead['step_without']:.1f} ms; the monitor's hook: median {1e3 * overhead['hook']:.2f} ms")
        print(f"monitor time / step time (median over the monitored steps): {overhead['share']:.2%}")

if __name__ == "__main__":
    main()
