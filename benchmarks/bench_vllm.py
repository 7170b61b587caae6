"""What vLLM costs and shows in the demo run (``configs/rl_vllm.yaml``'s ``VLLMRLModule``), measured in one process.

Cost, one run of the demo at its defaults (a float32 engine) with the monitor at Lightning's default
interval (50 steps):

* the monitor's hook, timed directly, per logged and per other step, and averaged over all steps as
  a share of the median step (a step samples with vLLM, so it is long beside the hook);
* one weight sync (``VLLMWeightSync.push``: cast, in-place reload, prefix-cache reset) of the tiny model;
* after training, on the final weights: ``VLLMSamplingClient`` (vLLM's prompt logprobs) against the
  local ``TorchSamplingClient`` on the same sequences, side by side, repeated alternately (tokens/s,
  best of the repeats), and their largest difference.

``--gaps``: the demo's sampler-vs-trainer gap per variant (``--variants``), the monitor judging every
step: a float32 engine, a bfloat16 engine, and a 256-token system prompt (two full KV blocks on a
CPU) with the prefix cache reset after each push or not (the fault): mean |d| (d = trainer - sampler
logprob), k3, the relative gap mean d² / var(s) and the causes the diagnosis names.

    python benchmarks/bench_vllm.py                      # cost: 100 steps, 256 sequences
    python benchmarks/bench_vllm.py --gaps               # and the gaps, 20 steps per variant
    python benchmarks/bench_vllm.py --steps 4 --log-every-n-steps 2 --sequences 8 --repeats 1 \\
        --gaps --gap-steps 2 --variants no_reset                           # smoke

Needs vLLM (README "vLLM as the sampler"); run with OMP_NUM_THREADS=1. Writes only in a temporary directory.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up and per-reload lines between the figures

from bench_callback import NullLogger, StepTimes, TimedMonitor, hook_lines  # noqa: E402
from machine import cpu_name  # noqa: E402

from loops_callbacks import KLSampleTrainMonitor  # noqa: E402
from loops_callbacks.demo.data import PromptDataModule  # noqa: E402
from loops_callbacks.demo.vllm_rl import VLLMRLModule  # noqa: E402
from loops_callbacks.integrations.vllm import VLLMSamplingClient, VLLMWarning  # noqa: E402
from loops_callbacks.reference.clients import TorchSamplingClient  # noqa: E402
from loops_callbacks.reference.packing import PackedTokens  # noqa: E402
from loops_callbacks.divergence.monitor import MediaOptions

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "float32": ("float32 engine", {}),
    "bfloat16": ("bfloat16 engine", {"engine_dtype": "bfloat16"}),
    "reset": ("256-token system prompt, prefix cache reset", {"system_prompt_tokens": 256}),
    "no_reset": ("256-token system prompt, no reset (the fault)", {"system_prompt_tokens": 256,
                                                                     "reset_prefix_cache": False}),
}


class SyncTimes(pl.Callback):
    """The weight sync's time of every step."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: VLLMRLModule, *args: Any) -> None:
        self.seconds.append(module.weight_sync.last_push_seconds)


class ScorerComparison(pl.Callback):
    """When training ends (the engine still up): the vLLM reference scorer against the local one, final weights."""

    def __init__(self, sequences: int, repeats: int) -> None:
        self.sequences, self.repeats = sequences, repeats
        self.result: dict[str, float] = {}

    def on_train_end(self, trainer: pl.Trainer, module: VLLMRLModule) -> None:
        module.weight_sync.push(module)
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, 257, (self.sequences,), generator=generator).tolist()
        vocab = module.tokenizer.vocab_size
        packed = PackedTokens.from_sequences([torch.randint(1, vocab, (n,), generator=generator).tolist()
                                              for n in lengths])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", VLLMWarning)  # the demo's engine has prefix caching on: skipped, said
            clients = {"vllm": VLLMSamplingClient(module.llm), "torch": TorchSamplingClient(module.policy)}
        best = {name: float("inf") for name in clients}
        values = {}
        for _ in range(self.repeats):
            for name, client in clients.items():
                start = time.perf_counter()
                values[name] = client.score_packed(packed)
                best[name] = min(best[name], time.perf_counter() - start)
        module.policy.train()
        self.result = {
            "parameters": sum(p.numel() for p in module.policy.parameters()),
            "tokens": packed.num_tokens,
            **{f"{name}_tokens_per_s": packed.num_tokens / seconds for name, seconds in best.items()},
            "max_abs_diff": (values["vllm"] - values["torch"]).abs().max().item(),
        }


class GapRecorder(pl.Callback):
    """Per step, after the monitor: mean |d| of the step's action tokens, and what the monitor logged and named."""

    def __init__(self, monitor: KLSampleTrainMonitor) -> None:
        self.monitor = monitor
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        d = (outputs["training_logprobs"].detach() - outputs["logprobs"])[outputs["mask"] > 0].double()
        metrics = {key.rsplit("/", 1)[-1]: float(value) for key, value in trainer.callback_metrics.items()}
        diagnosis = self.monitor.last_diagnosis
        self.rows.append({
            "mean_abs_d": d.abs().mean().item(),
            "k3": metrics.get("kl_sample_train_k3", float("nan")),
            "relative_gap": metrics.get("relative_gap", float("nan")),
            "cause": diagnosis.cause if diagnosis is not None else "-",
        })


def fit(root: str, steps: int, callbacks: list[pl.Callback], log_every_n_steps: int = 50, **module_args: Any) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=NullLogger(), callbacks=callbacks,
        log_every_n_steps=log_every_n_steps, default_root_dir=root, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(VLLMRLModule(**module_args), PromptDataModule(num_digits=4, batch_size=8))


def cost(root: str, steps: int, sequences: int, repeats: int, log_every_n_steps: int) -> None:
    timer, syncs, monitor = StepTimes(), SyncTimes(), TimedMonitor()
    scorer = ScorerComparison(sequences, repeats)
    fit(root, steps, [timer, syncs, monitor, scorer], log_every_n_steps=log_every_n_steps)
    step_times = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    median_step = statistics.median(step_times)
    print(f"\nCost: {steps} steps of the demo (8 prompts x 8 completions a step, float32 engine), "
          f"median step {median_step * 1e3:.1f} ms")
    hook_lines(f"monitor (defaults, logged every {log_every_n_steps} steps)", monitor.hook_seconds, median_step)
    result = scorer.result
    print(f"weight sync (tiny Llama, {result['parameters']:,} parameters): "
          f"median {statistics.median(syncs.seconds) * 1e3:.1f} ms, fastest {min(syncs.seconds) * 1e3:.1f} ms "
          f"= {statistics.median(syncs.seconds) / median_step:.1%} of a step")
    print(f"reference scoring, {sequences} sequences of 16-256 tokens ({result['tokens']:,} tokens), best of {repeats}: "
          f"VLLMSamplingClient {result['vllm_tokens_per_s']:,.0f} tokens/s, TorchSamplingClient "
          f"{result['torch_tokens_per_s']:,.0f} tokens/s ({result['vllm_tokens_per_s'] / result['torch_tokens_per_s']:.2f}x); "
          f"largest |difference| {result['max_abs_diff']:.2e}")


def gaps(root: str, steps: int, variants: list[str]) -> None:
    print(f"\nGaps: {steps} steps per variant, the monitor judging every step (d = trainer - sampler logprob; "
          "means over the steps after the first)")
    print("| variant | mean \\|d\\| | k3 (median) | relative gap (median) | named causes |")
    print("|---|---|---|---|---|")
    for name in variants:
        label, module_args = VARIANTS[name]
        monitor = KLSampleTrainMonitor(
            media=MediaOptions(log_histogram=False, log_worst_tokens=False), log_every_n_steps=1)
        recorder = GapRecorder(monitor)
        fit(os.path.join(root, name), steps, [monitor, recorder], log_every_n_steps=1, **module_args)
        rows = recorder.rows[1:] or recorder.rows  # step 0: no cached prefix of older weights yet
        causes = collections.Counter(row["cause"] for row in recorder.rows)
        print(f"| {label} | {statistics.mean(r['mean_abs_d'] for r in rows):.3g} | "
              f"{statistics.median(r['k3'] for r in rows):.3g} | {statistics.median(r['relative_gap'] for r in rows):.3g} | "
              f"{', '.join(f'{cause} {count}' for cause, count in causes.most_common())} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps of the cost run")
    parser.add_argument("--log-every-n-steps", type=int, default=50, help="the cost run's (Lightning's default)")
    parser.add_argument("--sequences", type=int, default=256, help="sequences scored by each reference client")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of the scoring")
    parser.add_argument("--gaps", action="store_true", help="also the demo's gap per variant")
    parser.add_argument("--gap-steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", module="lightning")
    import vllm

    print(f"CPU: {cpu_name()}; vllm {vllm.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as root:
        cost(os.path.join(root, "cost"), args.steps, args.sequences, args.repeats, args.log_every_n_steps)
        if args.gaps:
            gaps(root, args.gap_steps, args.variants)


if __name__ == "__main__":
    main()
