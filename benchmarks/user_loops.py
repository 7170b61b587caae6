"""RL loops as a user writes them from the README: the diagnosis judged on runs it was never tuned on.

Each loop is a LightningModule around a tiny random-init Hugging Face causal LM (GPT-2 or Llama,
built from a config, never downloaded): a copy of it is the sampler (bf16 or fp32), which draws
``group`` completions per prompt with ``generate(do_sample=True, top_k=0)`` and reports the
log-softmax of its own logits; the policy scores the same tokens in float32 with
``token_logprobs``, takes a GRPO-style step on a toy reward (completion tokens below a quarter of
the vocabulary), and hands everything to ``KLSampleTrainMonitor`` as the README's contract says,
``policy_version`` included. ``sync`` says whether the sampler receives the policy's weights after
every optimizer step; ``dropout`` is the model config's dropout (GPT-2's residual, embedding and
attention dropout; Llama's attention dropout).

A setting is healthy when the sampler is synced and dropout is 0: then only ``none``,
``precision`` or ``unclear`` are right. Never synced, the right cause is ``stale`` from the second
step on; with dropout on, ``dropout`` (observed) must be said, and beside it whatever dropout
cannot explain.

Two sets share this code and nothing else: ``dev`` (looked at while the rules were changed) and
``eval`` (other seeds, sizes and lengths; only reported). ``python benchmarks/user_loops.py --set
eval`` prints the counts per setting and the false-cause rate over healthy logged steps.

Example (two logged steps of a tiny loop, a few seconds on a CPU):
    >>> setting = Setting("gpt2", "bfloat16", sync=True, dropout=0.0, seed=0, steps=2, batch=4, group=2)
    >>> [step.cause in ("none", "precision", "unclear") for step in run(setting)]
    [True, True]
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

from loops_callbacks import KLSampleTrainMonitor, token_logprobs  # noqa: E402
from loops_callbacks.divergence.monitor import MediaOptions

HEALTHY_CAUSES = ("none", "precision", "unclear")


@dataclass(frozen=True)
class Setting:
    """One user loop: the model family, the sampler's dtype, whether it is synced, the dropout, and sizes."""

    model: str  # "gpt2" or "llama"
    sampler_dtype: str  # "bfloat16" or "float32"
    sync: bool
    dropout: float
    seed: int
    steps: int = 60
    batch: int = 16  # prompts per step
    group: int = 4  # completions per prompt
    prompt_length: int = 8
    completion: int = 24
    vocab: int = 96
    width: int = 64
    layers: int = 2
    lr: float = 3e-3

    @property
    def healthy(self) -> bool:
        return self.sync and self.dropout == 0.0

    @property
    def name(self) -> str:
        sync = "synced" if self.sync else "never synced"
        return f"{self.model}, {self.sampler_dtype} sampler, {sync}, dropout {self.dropout:g}, seed {self.seed}"


@dataclass(frozen=True)
class Step:
    step: int
    cause: str
    message: str
    k3: float
    metrics: dict[str, float]


def new_model(setting: Setting) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(setting.seed)
    positions = setting.prompt_length + setting.completion + 8
    if setting.model == "gpt2":
        p = setting.dropout
        config = GPT2Config(
            vocab_size=setting.vocab, n_positions=positions, n_embd=setting.width, n_layer=setting.layers, n_head=2,
            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=1,
        )
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=setting.vocab, hidden_size=setting.width, intermediate_size=2 * setting.width,
        num_hidden_layers=setting.layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=positions, attention_dropout=setting.dropout, bos_token_id=0, eos_token_id=1,
    )
    return LlamaForCausalLM(config)


class UserRL(pl.LightningModule):
    """The loop a user writes: sample with the sampler copy, score with the policy, step, sync."""

    def __init__(self, setting: Setting) -> None:
        super().__init__()
        self.setting = setting
        self.policy = new_model(setting)
        self.policy.generation_config.pad_token_id = 0
        sampler = copy.deepcopy(self.policy).to(getattr(torch, setting.sampler_dtype)).eval()
        self.__dict__["sampler"] = sampler  # not a child module: Lightning must not train or move it
        self.sampler_version = 0
        self.generator = torch.Generator().manual_seed(setting.seed + 1)
        self.kept: list[dict[str, torch.Tensor]] | None = None  # each step's batch fields, when asked to keep them

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        s = self.setting
        prompts = torch.randint(2, s.vocab, (s.steps, s.batch, s.prompt_length), generator=self.generator)
        return torch.utils.data.DataLoader(list(prompts), batch_size=None)

    def training_step(self, prompts: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        s = self.setting
        prompts = prompts.repeat_interleave(s.group, dim=0)
        with torch.no_grad():
            out = self.sampler.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=1.0,
                temperature=1.0, max_new_tokens=s.completion, min_new_tokens=s.completion, eos_token_id=None,
                output_logits=True, return_dict_in_generate=True,
            )
        sequences = out.sequences
        completion = sequences[:, s.prompt_length:]
        sampled = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
        sampled = sampled.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        input_ids, target_tokens = sequences[:, :-1], sequences[:, 1:]
        first = s.prompt_length - 1  # position k predicts token k + 1: the first completion token
        logprobs = torch.zeros(target_tokens.shape)
        logprobs[:, first:] = sampled
        mask = torch.zeros(target_tokens.shape)
        mask[:, first:] = 1.0
        reward = (completion < s.vocab // 4).float().mean(dim=1)
        grouped = reward.view(-1, s.group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
        training_logprobs = token_logprobs(self.policy(input_ids).logits, target_tokens)
        loss = -(advantages[:, None] * training_logprobs * mask).sum() / mask.sum()
        out = {
            "loss": loss, "training_logprobs": training_logprobs, "logprobs": logprobs, "mask": mask,
            "advantages": advantages, "target_tokens": target_tokens, "input_ids": input_ids,
            "policy_version": torch.full((len(sequences),), self.sampler_version),
        }
        if self.kept is not None:
            self.kept.append({k: v.detach().clone() for k, v in out.items() if k != "loss"})
        return out

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.setting.sync:
            self.sampler.load_state_dict(self.policy.state_dict())
            self.sampler_version = self.trainer.global_step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.setting.lr)


class _Record(pl.Callback):
    def __init__(self, monitor: KLSampleTrainMonitor) -> None:
        self.monitor, self.steps = monitor, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        diagnosis, metrics = self.monitor.last_diagnosis, trainer.callback_metrics
        if diagnosis is not None:
            k3 = metrics.get("optim/train-sample-div/kl_sample_train_k3", torch.tensor(float("nan")))
            numbers = {k.split("train-sample-div/")[-1]: float(v) for k, v in metrics.items() if v.numel() == 1}
            self.steps.append(Step(trainer.global_step - 1, diagnosis.label, diagnosis.message, float(k3), numbers))


def run(setting: Setting, kept: list[dict[str, torch.Tensor]] | None = None) -> list[Step]:
    """Each logged step's diagnosis (the monitor logs every step) of one loop; ``kept`` collects its batches."""
    pl.seed_everything(setting.seed, verbose=False)
    module = UserRL(setting)
    module.kept = kept
    return _diagnoses(module, setting.steps)


class _Replay(pl.LightningModule):
    """Replays a loop's kept batches through the monitor; ``policy`` is the loop's model in train mode, so
    the monitor sees the dropout the loop had."""

    def __init__(self, setting: Setting, steps: list[dict[str, torch.Tensor]]) -> None:
        super().__init__()
        self.policy, self.steps = new_model(setting), steps
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.steps, batch_size=None)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": self.anchor * 0.0, **batch}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.anchor], lr=0.0)


def replay(setting: Setting, steps: list[dict[str, torch.Tensor]]) -> list[Step]:
    """The diagnoses of a loop's kept batches, replayed through a fresh monitor (same numbers, same order)."""
    return _diagnoses(_Replay(setting, steps), len(steps))


def _diagnoses(module: pl.LightningModule, steps: int) -> list[Step]:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_histogram=False, log_worst_tokens=False), log_every_n_steps=1)
    record = _Record(monitor)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=[monitor, record],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    return record.steps


def right(setting: Setting, step: Step) -> bool:
    """Whether a step's named cause is right for its loop (module docstring); step 0 of a loop is in sync."""
    if setting.healthy or (step.step == 0 and setting.dropout == 0.0):
        return step.cause in HEALTHY_CAUSES
    if setting.dropout > 0.0:  # observed; beside it, a never-synced sampler once the gap has grown for 3 steps
        return step.cause == "dropout" or (not setting.sync and step.cause == "dropout + stale")
    return step.cause == "stale"


def settings(which: str, steps: int) -> list[Setting]:
    """The ``dev`` or ``eval`` set: every model x sampler dtype healthy, then never synced and dropout on."""
    if which == "dev":
        seeds, sizes = (0, 1), {}
    else:
        seeds, sizes = (10, 11), {"vocab": 160, "width": 128, "prompt_length": 12, "completion": 32, "lr": 2e-3}
    found = []
    for seed in seeds:
        for model in ("gpt2", "llama"):
            for dtype in ("bfloat16", "float32"):
                found.append(Setting(model, dtype, sync=True, dropout=0.0, seed=seed, steps=steps, **sizes))
        for model in ("gpt2", "llama"):
            found += [
                Setting(model, "bfloat16", sync=False, dropout=0.0, seed=seed, steps=steps, **sizes),
                Setting(model, "bfloat16", sync=True, dropout=0.1, seed=seed, steps=steps, **sizes),
                Setting(model, "bfloat16", sync=False, dropout=0.1, seed=seed, steps=steps, **sizes),
            ]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=("dev", "eval"), default="eval")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default="", help="run the settings whose name contains this text")
    parser.add_argument("--show", action="store_true", help="print each named cause's message once")
    parser.add_argument("--json", help="write every logged step's diagnosis and numbers to this file")
    parser.add_argument("--save-dir", help="save each loop's batch fields (for replaying them) in this folder")
    parser.add_argument("--replay", help="replay the batches saved in this folder instead of training")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# user loops, set {args.set}, {args.steps} steps each; {cpu_name()}")
    print("| loop | logged steps | named (steps) | right |\n|---|---:|---|---:|")
    healthy, dump = collections.Counter(), []
    for setting in settings(args.set, args.steps):
        if args.only not in setting.name:
            continue
        kept = [] if args.save_dir else None
        if args.replay:
            steps = replay(setting, torch.load(Path(args.replay) / f"{_file_name(setting)}.pt")["steps"])
        else:
            steps = run(setting, kept)
        if kept is not None:
            Path(args.save_dir).mkdir(parents=True, exist_ok=True)
            torch.save({"setting": dataclasses.asdict(setting), "steps": kept},
                       Path(args.save_dir) / f"{_file_name(setting)}.pt")
        counts = collections.Counter(step.cause for step in steps)
        named = ", ".join(f"{cause} {n}" for cause, n in counts.most_common())
        print(f"| {setting.name} | {len(steps)} | {named} | {sum(right(setting, s) for s in steps)} |")
        dump.append({"setting": dataclasses.asdict(setting), "steps": [dataclasses.asdict(s) for s in steps]})
        if setting.healthy:
            healthy.update("healthy" if s.cause in HEALTHY_CAUSES else "false cause" for s in steps)
        if args.show:
            for cause in counts:
                step = next(s for s in steps if s.cause == cause)
                print(f"    step {step.step} (k3 {step.k3:.3g}): {step.message}")
    if args.json:
        Path(args.json).write_text(json.dumps(dump))
    total = healthy["healthy"] + healthy["false cause"]
    print(f"\nhealthy logged steps named a cause other than none, precision or unclear: {healthy['false cause']} of {total}")


def _file_name(setting: Setting) -> str:
    return setting.name.replace(", ", "_").replace(" ", "-")


if __name__ == "__main__":
    main()
