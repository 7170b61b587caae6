"""A vLLM fault set of its own: RL loops sampled by a real vLLM engine, and the diagnosis named on each step.

Each loop trains a tiny random-init Hugging Face Llama (built from a config into a temporary
directory, never downloaded: hidden 128, 2 heads of 64, 2 layers, a 512-token vocabulary, its
output layer scaled so distributions are peaked) by GRPO on a toy reward (completion tokens below
a quarter of the vocabulary), Adam steps, ``group`` completions per prompt. The sampler is an
in-process ``vllm.LLM`` of the same checkpoint, synced through ``VLLMWeightSync`` before sampling;
``generate_rollouts`` hands the monitor its batch (``policy_version``, ``sampler_facts``); the
trainer scores the sampled tokens in float32 at temperature 1 with ``token_logprobs(...,
with_entropy=True)``, so what was sampled is checked too (``sampling_z``).
``KLSampleTrainMonitor(log_every_n_steps=1)`` judges every step.

A setting runs ``healthy_steps`` (5) healthy steps first (pushed every step, temperature 1, prefix
cache reset: the monitor calibrates on them), then its fault for ``fault_steps`` (12). Settings share
one engine per (dtype, logprobs mode, token budget), started once (~11 s) and given the checkpoint's
weights again when a setting starts (its first push). The true causes (``right``):

* float32 and bfloat16 engines synced every step: healthy (``none``, ``precision`` or ``unclear``);
* either engine never synced after the healthy steps, or synced every 4 steps: ``stale`` where its
  weights are behind the trainer's, healthy on the steps it was just synced;
* prompts sharing a 256-token system prefix (two full KV blocks on a CPU), the prefix cache not
  reset after a push (float32 and bfloat16 engines): ``prefix_cache``; the same prompts with the
  reset: healthy;
* vLLM's default raw logprobs reported while sampling at temperature 0.7, top-p 0.9, top-k 20:
  ``sampling``; processed logprobs at those settings, the trainer at temperature 1: ``temperature``
  or ``truncation``;
* 600-token prompts prefilled in chunks (an engine whose token budget is 256), and 16 or 128
  prompts a step: healthy.

``python benchmarks/vllm_faults.py`` prints the CPU, a confusion table (true cause by named cause,
with the share named right) and a table per setting, with its steps judged (a step whose every
group's rewards tie has no counted token, so it is not judged); ``--show`` each named cause's
message and numbers once per setting. ``--save-dir`` keeps every step's batch; ``--replay DIR`` judges the kept
batches again without vLLM (same numbers, same order: what to iterate on). The engine's sampling
follows the torch seed set when a setting starts, so ``--only`` samples what the full run sampled.

Needs vLLM (README "vLLM as the sampler"); run with ``OMP_NUM_THREADS=1``. Writes only in a
temporary directory, and where ``--save-dir`` / ``--json`` say.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's start-up warnings between the tables

from machine import cpu_name  # noqa: E402
from user_loops import HEALTHY_CAUSES, Step, _diagnoses  # noqa: E402

from loops_callbacks import token_logprobs  # noqa: E402
from loops_callbacks.demo.vllm_rl import ENGINE_ENVIRONMENT  # noqa: E402
from loops_callbacks.divergence.batch import SamplerFacts  # noqa: E402
from loops_callbacks.integrations.vllm import (  # noqa: E402
    VLLMWarning, VLLMWeightSync, generate_rollouts, shutdown_engine,
)

VOCAB, BOS, EOS = 512, 0, 1
MAX_MODEL_LEN = 1024
RIGHT = {
    "healthy": HEALTHY_CAUSES,
    "stale": ("stale",),
    "prefix_cache": ("prefix_cache",),
    "sampling": ("sampling",),
    "temperature / truncation": ("temperature", "truncation"),
}
"""The causes that are right for each true cause."""


@dataclass(frozen=True)
class Setting:
    """One loop: its fault (what changes after the healthy steps), the engine, the sizes."""

    name: str
    truth: str  # the fault's true cause, a key of RIGHT
    dtype: str = "float32"  # the engine's
    logprobs_mode: str = "raw_logprobs"
    sync_every: int | None = 1  # after the healthy steps, push every this many steps (None: never)
    reset_prefix_cache: bool = True  # after the healthy steps
    temperature: float = 1.0  # sampling, after the healthy steps (the trainer scores at 1)
    top_p: float = 1.0
    top_k: int = 0
    system_prefix: int = 0  # tokens every prompt starts with
    prompt_length: int = 16  # tokens after the system prefix
    prompts: int = 32
    group: int = 4
    completion: int = 32  # tokens sampled at most (a sampled EOS ends a completion)
    token_budget: int | None = None  # the engine's max_num_batched_tokens (None: vLLM's default)
    healthy_steps: int = 5
    fault_steps: int = 12
    seed: int = 0
    sharpness: float = 20.0  # the output layer's scale: about 1.8 nats of entropy per sampled token
    lr: float = 1e-4

    @property
    def engine(self) -> tuple[str, str, int | None]:
        return self.dtype, self.logprobs_mode, self.token_budget

    @property
    def steps(self) -> int:
        return self.healthy_steps + self.fault_steps

    def pushes_at(self, step: int) -> bool:
        """Whether the trainer's weights are pushed into the engine before step ``step`` samples."""
        fault_step = step - self.healthy_steps
        return fault_step < 0 or (self.sync_every is not None and fault_step % self.sync_every == 0)

    def lag(self, step: int) -> int:
        """Optimizer steps the engine's weights are behind the trainer's at ``step``.

        Example (healthy steps 0-4, then pushed before steps 5, 9, 13):
            >>> [Setting("every 4", "stale", sync_every=4).lag(step) for step in range(4, 11)]
            [0, 0, 1, 2, 3, 0, 1]
        """
        return step - max(s for s in range(step + 1) if self.pushes_at(s))


def settings(**sizes: Any) -> list[Setting]:
    """The fault set (module docstring), grouped by engine; ``sizes`` override every setting's sizes."""
    truncated = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    found = [
        Setting("float32 engine, synced", "healthy"),
        Setting("16 prompts a step", "healthy", prompts=16),
        Setting("128 prompts a step", "healthy", prompts=128),
        Setting("256-token shared prefix, cache reset", "healthy", system_prefix=256),
        Setting("256-token shared prefix, cache not reset", "prefix_cache", system_prefix=256,
                reset_prefix_cache=False),
        Setting("raw logprobs, T 0.7 top-p 0.9 top-k 20", "sampling", **truncated),
        Setting("float32 engine, never synced", "stale", sync_every=None),
        Setting("float32 engine, synced every 4 steps", "stale", sync_every=4),
        Setting("bfloat16 engine, synced", "healthy", dtype="bfloat16"),
        Setting("bfloat16 engine, never synced", "stale", dtype="bfloat16", sync_every=None),
        Setting("bfloat16 engine, synced every 4 steps", "stale", dtype="bfloat16", sync_every=4),
        Setting("bfloat16 engine, 256-token prefix, cache not reset", "prefix_cache", dtype="bfloat16",
                system_prefix=256, reset_prefix_cache=False),
        Setting("processed logprobs, T 0.7 top-p 0.9 top-k 20", "temperature / truncation",
                logprobs_mode="processed_logprobs", **truncated),
        Setting("600-token prompts, chunked prefill", "healthy", prompt_length=600, token_budget=256),
    ]
    return [dataclasses.replace(setting, **sizes) for setting in found]


def truth(setting: Setting, step: int) -> str:
    """The true cause of a step: healthy before the fault, and on a stale loop's steps the engine is current."""
    if step < setting.healthy_steps or (setting.truth == "stale" and setting.lag(step) == 0):
        return "healthy"
    return setting.truth


def right(setting: Setting, step: Step) -> bool:
    """Whether the cause named on a step is right for it (``truth``)."""
    return step.cause in RIGHT[truth(setting, step.step)]


def number(step: Step, name: str) -> float:
    """A logged number of a step: a scalar (``sampling_z``) or a signature (``relative_gap``)."""
    return step.metrics.get(name, step.metrics.get(f"signature/{name}", float("nan")))


# ---- the loop --------------------------------------------------------------------------------------


def save_checkpoint(setting: Setting, directory: Path) -> None:
    """The tiny Llama every loop starts from, in ``directory`` (Hugging Face format)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(setting.seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_MODEL_LEN, bos_token_id=BOS,
        eos_token_id=EOS, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(setting.sharpness)
    model.save_pretrained(directory)


def start_engine(checkpoint: Path, setting: Setting) -> Any:
    """An in-process ``vllm.LLM`` on ``checkpoint`` with the setting's engine arguments, prefix caching on."""
    for name, value in ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    budget = {} if setting.token_budget is None else {"max_num_batched_tokens": setting.token_budget}
    return LLM(
        model=str(checkpoint), dtype=setting.dtype, logprobs_mode=setting.logprobs_mode, max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.05, enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=True,
        seed=setting.seed, **budget,
    )


class VLLMFaultLoop(pl.LightningModule):
    """GRPO on the checkpoint, sampled by ``llm``: healthy steps first, then the setting's fault."""

    def __init__(self, setting: Setting, checkpoint: Path, llm: Any) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM
        from vllm import SamplingParams

        self.setting = setting
        self.policy = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.__dict__["llm"] = llm  # not a child module: Lightning must not train or move it
        self.sync = VLLMWeightSync(llm)
        common = {"n": setting.group, "max_tokens": setting.completion, "logprobs": 0, "flat_logprobs": True,
                  "stop_token_ids": [EOS], "detokenize": False}
        self.healthy_params = SamplingParams(**common)
        self.fault_params = SamplingParams(
            **common, temperature=setting.temperature, top_p=setting.top_p, top_k=setting.top_k
        )
        self.kept: list[dict[str, Any]] | None = None  # each step's batch fields, when asked to keep them

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        s = self.setting
        generator = torch.Generator().manual_seed(s.seed + 1)
        system = torch.randint(2, VOCAB, (s.system_prefix,), generator=generator)
        tasks = torch.randint(2, VOCAB, (s.steps, s.prompts, s.prompt_length), generator=generator)
        prompts = torch.cat([system.expand(s.steps, s.prompts, -1), tasks], dim=-1)
        return torch.utils.data.DataLoader(list(prompts), batch_size=None)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if self.setting.pushes_at(step):
            self.sync.reset_prefix_cache = step < self.setting.healthy_steps or self.setting.reset_prefix_cache
            self.sync.push(self)  # version = the trainer's optimizer steps

    def training_step(self, prompts: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        s = self.setting
        params = self.healthy_params if self.trainer.global_step < s.healthy_steps else self.fault_params
        rollouts = generate_rollouts(self.llm, prompts.tolist(), params, weight_sync=self.sync, pad_id=BOS)
        targets, mask = rollouts["target_tokens"], rollouts["mask"]
        reward = ((targets < VOCAB // 4) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        grouped = reward.view(-1, s.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        scored = token_logprobs(self.policy(rollouts["input_ids"]).logits, targets, with_entropy=True)
        loss = -(advantages[:, None] * scored.logprobs * mask).sum() / mask.sum()
        out = {**rollouts, **scored.outputs, "loss": loss, "advantages": advantages}
        if self.kept is not None:
            kept = {k: v.detach().clone() for k, v in out.items() if isinstance(v, torch.Tensor) and k != "loss"}
            self.kept.append({**kept, "sampler_facts": rollouts["sampler_facts"]._asdict()})
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.setting.lr)


def run(setting: Setting, checkpoint: Path, llm: Any, kept: list[dict[str, Any]] | None = None) -> list[Step]:
    """Each logged step's diagnosis of one loop on ``llm``; ``kept`` collects its batches."""
    pl.seed_everything(setting.seed, verbose=False)  # the engine samples in this process, from torch's RNG
    module = VLLMFaultLoop(setting, checkpoint, llm)
    module.kept = kept
    return _diagnoses(module, setting.steps)


class _Replay(pl.LightningModule):
    """Replays a loop's kept batches through the monitor (the loop's trainer has no dropout to mirror)."""

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        super().__init__()
        self.steps = steps
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(range(len(self.steps)), batch_size=None)

    def training_step(self, index: torch.Tensor, batch_idx: int) -> dict[str, Any]:
        kept = self.steps[int(index)]
        return {**kept, "sampler_facts": SamplerFacts(**kept["sampler_facts"]), "loss": self.anchor * 0.0}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.anchor], lr=0.0)


def replay(steps: list[dict[str, Any]]) -> list[Step]:
    """The diagnoses of a loop's kept batches, replayed through a fresh monitor (same numbers, same order)."""
    return _diagnoses(_Replay(steps), len(steps))


# ---- the tables ------------------------------------------------------------------------------------


def confusion_lines(results: list[tuple[Setting, list[Step]]]) -> list[str]:
    """True cause (rows) by named cause (columns), every logged step, with the share named right."""
    counts: dict[str, collections.Counter[str]] = {cause: collections.Counter() for cause in RIGHT}
    rights: collections.Counter[str] = collections.Counter()
    for setting, steps in results:
        for step in steps:
            counts[truth(setting, step.step)][step.cause] += 1
            rights[truth(setting, step.step)] += right(setting, step)
    named = sorted({cause for row in counts.values() for cause in row})
    lines = [f"| true cause | {' | '.join(named)} | right |", "|---|" + "---:|" * (len(named) + 1)]
    for cause, row in counts.items():
        total = sum(row.values())
        if total:
            cells = " | ".join(str(row[name]) for name in named)
            lines.append(f"| {cause} | {cells} | {rights[cause]}/{total} ({rights[cause] / total:.0%}) |")
    return lines


def setting_line(setting: Setting, steps: list[Step], seconds: float) -> str:
    """One setting's row: the steps judged (a step whose groups all tied has no counted token), the causes named
    on its healthy and its fault steps, and how many are right."""

    def named(chosen: list[Step]) -> str:
        return ", ".join(f"{cause} {n}" for cause, n in collections.Counter(s.cause for s in chosen).most_common())

    healthy = [s for s in steps if s.step < setting.healthy_steps]
    fault = [s for s in steps if s.step >= setting.healthy_steps]
    fault_right = sum(right(setting, s) for s in fault)
    return (f"| {setting.name} | {setting.truth} | {len(steps)}/{setting.steps} | {named(healthy)} | {named(fault)} | "
            f"{sum(right(setting, s) for s in healthy)}/{len(healthy)} | {fault_right}/{len(fault)} | {seconds:.0f} |")


def show_lines(setting: Setting, steps: list[Step]) -> list[str]:
    """Each named cause's first step in a setting, with its message; then the numbers of every step named
    wrong or ``unclear``."""
    lines = []
    for cause in dict.fromkeys(s.cause for s in steps):
        step = next(s for s in steps if s.cause == cause)
        lines.append(f"    {_step_numbers(setting, step, SHOWN[:2])}: {step.message}")
    lines += [f"      {_step_numbers(setting, step, SHOWN)}" for step in steps
              if step.cause == "unclear" or not right(setting, step)]
    return lines


SHOWN = ("relative_gap", "sampling_z", "relative_gap_se", "frac_d_zero", "pearson", "temperature", "temperature_se",
         "sign_split", "frac_d_pos", "is_ratio_mean", "token_eta2", "context_fade", "context_fade_z")
"""The numbers ``--show`` prints of a step named wrong or ``unclear`` (the first two of every step it shows)."""


def _step_numbers(setting: Setting, step: Step, names: tuple[str, ...]) -> str:
    mark = "right" if right(setting, step) else f"WRONG (true: {truth(setting, step.step)})"
    numbers = ", ".join(f"{name} {number(step, name):.3g}" for name in names)
    return f"step {step.step} (lag {setting.lag(step.step)}) {step.cause}, {mark}: k3 {step.k3:.3g}, {numbers}"


def kept_file_name(setting: Setting) -> str:
    """The file of a setting's kept batches in ``--save-dir``."""
    return "".join(c if c.isalnum() else "-" for c in setting.name) + ".pt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the settings whose name contains this text")
    parser.add_argument("--show", action="store_true", help="print each named cause's message once per setting")
    parser.add_argument("--healthy-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12, help="fault steps per setting")
    parser.add_argument("--prompts", type=int, help="prompts per step (default: each setting's)")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--json", help="write every logged step's diagnosis and numbers to this file")
    parser.add_argument("--save-dir", help="save each loop's batch fields (for replaying them) in this folder")
    parser.add_argument("--replay", help="replay the batches saved in this folder instead of training")
    parser.add_argument("--seed", type=int, default=0, help="another seed is another set (model, prompts, draws)")
    parser.add_argument("--sharpness", type=float, default=20.0, help="the output layer's scale")
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", category=VLLMWarning)  # the raw-logprobs setting is meant to be warned about
    sizes = {"healthy_steps": args.healthy_steps, "fault_steps": args.steps, "group": args.group,
             "completion": args.completion, "seed": args.seed, "sharpness": args.sharpness, "lr": args.lr,
             **({"prompts": args.prompts} if args.prompts else {})}
    chosen = [s for s in settings(**sizes) if args.only in s.name]
    started = time.perf_counter()
    results, shown, dump = [], [], []
    with tempfile.TemporaryDirectory() as root:
        checkpoint = Path(root) / "tiny-llama"
        if not args.replay and chosen:
            save_checkpoint(chosen[0], checkpoint)
        for _, group in itertools.groupby(chosen, key=lambda s: s.engine):
            group = list(group)
            llm = None if args.replay else start_engine(checkpoint, group[0])
            try:
                for setting in group:
                    start = time.perf_counter()
                    kept = [] if args.save_dir else None
                    if args.replay:
                        steps = replay(torch.load(Path(args.replay) / kept_file_name(setting))["steps"])
                    else:
                        steps = run(setting, checkpoint, llm, kept)
                    if kept is not None:
                        Path(args.save_dir).mkdir(parents=True, exist_ok=True)
                        torch.save({"setting": dataclasses.asdict(setting), "steps": kept},
                                   Path(args.save_dir) / kept_file_name(setting))
                    results.append((setting, steps, time.perf_counter() - start))
                    dump.append({"setting": dataclasses.asdict(setting),
                                 "steps": [dataclasses.asdict(s) for s in steps]})
            finally:
                if llm is not None:
                    shutdown_engine(llm)
    minutes = (time.perf_counter() - started) / 60
    source = f"replayed from {args.replay}" if args.replay else "sampled by vLLM"
    print(f"# vLLM faults, seed {args.seed}, output scale {args.sharpness:g}, lr {args.lr:g}, "
          f"{args.healthy_steps} healthy + {args.steps} fault steps per setting, {source}; "
          f"{cpu_name()}; {minutes:.1f} min")
    print("\n" + "\n".join(confusion_lines([(s, steps) for s, steps, _ in results])))
    print("\n| setting | true cause | judged | named, healthy steps | named, fault steps | right, healthy "
          "| right, fault | s |\n|---|---|---:|---|---|---:|---:|---:|")
    for setting, steps, seconds in results:
        print(setting_line(setting, steps, seconds))
        if args.show:
            shown += [f"{setting.name}:", *show_lines(setting, steps)]
    if shown:
        print("\n" + "\n".join(shown))
    if args.json:
        Path(args.json).write_text(json.dumps(dump))


if __name__ == "__main__":
    main()
