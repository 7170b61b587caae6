"""GRPO-style RL on ``ReverseDigitsTask`` with a separate, possibly stale or low-precision sampler.

``RLPolicyModule`` reproduces the shape of an async RL system in one process: a *sampler* model
generates completions, the *policy* (the model being trained) scores them, and the Loops
``importance_sampling`` loss corrects for the difference between the two. The sampler is a copy of
the policy kept in ``sampler_precision`` that receives the policy's weights every ``sync_every``
optimizer steps, so the sampler/trainer logprob gap that ``loops_log_kl_sample_train`` monitors is
real and controllable:

- ``sampler_precision="float32", sync_every=1``: no gap (the sampler's logprobs equal the
  trainer's exactly) unless the trainer runs under mixed precision;
- ``sampler_precision="bfloat16"``: the rounding gap of a bf16 inference engine;
- ``sync_every=k`` / ``None``: a sampler k steps behind / never updated (the stale-sampler demo);
- ``sampler_temperature``, ``sampler_top_k`` / ``sampler_top_p``, ``logprob_shift``,
  ``sampler_prompt``: seeded sampler faults (``demo.sampler_faults``; off by default), each with
  its own signature for the divergence diagnosis (``configs/rl_faults.yaml``).

What the bf16 sampler does. Its weights are bfloat16 (a sync rounds the policy's float32
weights to bf16, as loading them into a bf16 engine does) and every tensor its forward pass
stores is rounded to bf16: embedding sums, layer-norm, linear, GELU and attention outputs,
residual sums, the logits. The kernels run in float32 (``TinyCausalLM(compute_dtype=float32)``),
which is how bf16 kernels accumulate anyway, so the numbers are those of PyTorch's native bf16
forward up to summation order (about 0.1% of the logits differ, by about one bf16 ulp; the
bf16-vs-float32 gap is a thousand times larger) while CPUs without native bf16, which emulate
bf16 kernels several times slower than float32 ones, run it at float32 speed. Sampling keeps a
KV cache (one prompt pass, then one pass per new token, as an inference engine decodes); the
logprobs of the sampled tokens come from one more pass of the same sampler over the whole
sequence, the same shapes the trainer scores, so a float32 sampler agrees with the trainer exactly.

The loss is not clipped (as in Loops): even a never-updated sampler still lets the policy learn
the demo task, while the monitored gap grows to several nats per token. With ``correction`` (any
``loops_callbacks.correction`` spec, e.g. ``"token_truncate:2.0"``) the importance ratio is
replaced by that correction's weights, as TRL and verl apply them: the loss becomes
``-w * exp(trainer_lp - sg(trainer_lp)) * advantage`` with ``w`` the correction's (detached)
weight, 0 on the tokens it masks.

Each ``training_step`` takes ``{"prompt_ids": LongTensor[P, L]}`` (from ``PromptDataModule``),
samples ``group_size`` completions per prompt with the sampler, rewards them, centres the rewards
within each prompt's group (the advantages), and returns the loss with the padded tensors the
divergence callback reads (B = P * group_size rows, T = L + max_new_tokens - 1 positions, and
position k belongs to the token predicted at k):

=====================  ======================  =============================================
key                    shape, dtype            meaning
=====================  ======================  =============================================
``loss``               scalar                  mean over action tokens of ``-exp(trainer_lp - sampler_lp) * advantage`` (or ``correction``'s weight)
``training_logprobs``  [B, T] float32          trainer logprobs of ``target_tokens`` (with grad)
``logprobs``           [B, T] float32          sampler logprobs, detached; 0.0 off the action tokens
``mask``               [B, T] float32          1.0 on completion tokens (up to and including ``<eos>``)
``advantages``         [B] float32             reward minus the mean reward of the row's group
``input_ids``          [B, T] int64            sequence[:-1] (prompt + completion, right-padded)
``target_tokens``      [B, T] int64            sequence[1:]
=====================  ======================  =============================================

Logged: ``train/reward`` (mean reward of the sampled completions) and ``train/loss``.

Examples:
    >>> import lightning
    >>> from loops_callbacks.demo.data import PromptDataModule
    >>> module = RLPolicyModule(num_digits=3, group_size=4, sampler_precision="bfloat16")
    >>> trainer = lightning.Trainer(max_steps=2, accelerator="cpu", logger=False,
    ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(module, PromptDataModule(num_digits=3, batch_size=2))
    >>> trainer.global_step
    2
"""

from __future__ import annotations

import copy
import numbers
from typing import Any, Literal

import torch
from jsonargparse.typing import PositiveFloat, PositiveInt
from lightning.pytorch import LightningModule
from typing_extensions import override

from loops_callbacks.correction import apply_correction, parse_correction
from loops_callbacks.demo.model import KVCache, TinyCausalLM
from loops_callbacks.demo.sampler_faults import SamplerFaults
from loops_callbacks.demo.tasks import ReverseDigitsTask
from loops_callbacks.logprobs import token_logprobs
from loops_callbacks.validation import check, check_dtype, check_int

# The checkpoint key that records after how many optimizer steps the sampler last got weights.
_SYNCED_AT_KEY = "demo_rl_sampler_synced_at_step"


class RLPolicyModule(LightningModule):
    """A tiny policy trained by group-relative policy gradient, sampled by a separate sampler model.

    Args:
        num_digits: digits per ``ReverseDigitsTask`` prompt (match ``PromptDataModule``).
        num_symbols: how many of the digits 0-9 the prompts use.
        group_size: completions sampled per prompt (at least 2: advantages are relative to the group).
        d_model, n_layers, n_heads: size of the ``TinyCausalLM`` policy.
        lr: AdamW learning rate.
        sampler_precision: dtype of the sampler's weights and of every tensor its forward passes
            store (kernels run in float32; see the module docstring).
        sync_every: copy the policy's weights into the sampler every this many optimizer steps;
            ``None`` = never (the sampler stays the policy of the first training batch).
        sampler_temperature, sampler_top_k, sampler_top_p, logprob_shift, sampler_prompt: seeded
            sampler faults (``loops_callbacks.demo.sampler_faults``): a temperature applied on the
            sampler only, top-k / top-p truncation with renormalized logprobs, logprobs reported
            one position off, a different prompt template. The defaults change nothing.
        faults_from_step: the faults start after this many optimizer steps (before: a faithful
            sampler), so a demo can first train a policy worth diagnosing, then break its sampler.
        correction: a rollout correction applied in the loss (``loops_callbacks.correction``
            spec, e.g. ``"token_truncate:2.0"`` or ``"sequence_mask:3.0"``); ``None``: Loops'
            unclipped importance ratio.

    The sampler is a registered submodule without gradients: it moves with the module, is saved in
    checkpoints with its own (possibly stale) weights, and the checkpoint records when it was last
    synced, so a resumed run samples with exactly the weights an uninterrupted one would. Syncing
    happens in ``on_train_batch_start``, before any checkpoint of the coming step is written. A
    ``precision="bf16-true"`` trainer converts the whole module, sampler included, to bfloat16.

    Examples:
        >>> module = RLPolicyModule(num_digits=2, group_size=2)
        >>> out = module.training_step({"prompt_ids": module.task.sample_prompts(3)}, 0)
        >>> out["mask"].shape, out["advantages"].shape
        (torch.Size([6, 6]), torch.Size([6]))
    """

    def __init__(
        self,
        num_digits: PositiveInt = 4,
        num_symbols: int = 10,
        group_size: PositiveInt = 8,
        d_model: PositiveInt = 64,
        n_layers: PositiveInt = 2,
        n_heads: PositiveInt = 4,
        lr: PositiveFloat = 1e-3,
        sampler_precision: Literal["float32", "bfloat16"] = "float32",
        sync_every: PositiveInt | None = 1,
        sampler_temperature: PositiveFloat = 1.0,
        sampler_top_k: PositiveInt | None = None,
        sampler_top_p: PositiveFloat | None = None,
        logprob_shift: int = 0,
        sampler_prompt: Literal["same", "pad_as_bos", "no_bos"] = "same",
        faults_from_step: int = 0,
        correction: str | None = None,
    ) -> None:
        super().__init__()
        check_int("RLPolicyModule group_size (advantages are relative to the group)", group_size, least=2)
        check_int("RLPolicyModule sync_every (None: never sync)", sync_every, least=1, optional=True)
        sampler_dtype = check_dtype("RLPolicyModule sampler_precision", sampler_precision, ("float32", "bfloat16"))
        # a plain float: the optimizer state is pickled with it, and jsonargparse gives PositiveFloat
        self.lr = float(check("RLPolicyModule lr", lr, numbers.Real, "a positive number", lambda value: value > 0))
        self.faults = SamplerFaults(sampler_temperature, sampler_top_k, sampler_top_p, logprob_shift, sampler_prompt)
        self.faults_from_step = faults_from_step
        self.correction = parse_correction(correction) if correction is not None else None
        self.save_hyperparameters()
        self.task = ReverseDigitsTask(num_digits, num_symbols)
        self.tokenizer = self.task.tokenizer
        self.group_size = group_size
        self.sync_every = sync_every
        longest = self.task.prompt_length + self.task.max_new_tokens
        self.policy = TinyCausalLM(self.tokenizer.vocab_size, d_model, n_layers, n_heads, max_seq_len=longest)
        self.sampler = copy.deepcopy(self.policy).to(sampler_dtype).requires_grad_(False)
        self.sampler.compute_dtype = torch.float32  # bf16 storage, float32 kernels: a bf16 engine's numbers
        # Optimizer steps taken when the sampler last received the policy's weights; None = not yet
        # (the first training batch syncs, so weights loaded into the policy after __init__ count).
        self.sampler_synced_at_step: int | None = None

    @override
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The policy's logits ``[B, T, V]``."""
        return self.policy(input_ids)

    # ---- the sampler ---------------------------------------------------------------------------

    def _optimizer_steps(self) -> int:
        return self.trainer.global_step if self._trainer is not None else 0

    @property
    def active_faults(self) -> SamplerFaults:
        """The seeded faults in force now: none before ``faults_from_step`` optimizer steps."""
        return self.faults if self._optimizer_steps() >= self.faults_from_step else SamplerFaults()

    @torch.no_grad()
    def sync_sampler(self) -> None:
        """Copy the policy's weights into the sampler (cast to ``sampler_precision``)."""
        self.sampler.load_state_dict(self.policy.state_dict())
        self.sampler_synced_at_step = self._optimizer_steps()

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, repeats: int = 1) -> torch.Tensor:
        """Sample completions of ``prompt_ids [P, L]`` with the sampler (temperature 1).

        Each prompt is sampled ``repeats`` times (its samples are adjacent rows) and processed
        once: its keys and values are shared by its samples, as an engine's prefix cache does.
        Decoding keeps a KV cache, so each new token costs one one-token pass.

        Returns ``[P * repeats, max_new_tokens]`` token ids; positions after a row's first
        ``<eos>`` are ``pad_id``.
        """
        cache = KVCache()
        completion: list[torch.Tensor] = []
        faults = self.active_faults
        with torch.autocast(prompt_ids.device.type, enabled=False):  # the sampler's own precision
            logits = self.sampler(faults.perturb(prompt_ids, pad_id=self.tokenizer.pad_id), cache=cache)[:, -1].float()
            cache.repeat_interleave(repeats)
            logits = logits.repeat_interleave(repeats, dim=0)
            for step in range(self.task.max_new_tokens):  # one pass per new token, all rows at once
                if step:
                    logits = self.sampler(completion[-1], cache=cache)[:, -1].float()
                probs = faults.sampling_logprobs(logits).exp() if faults.changes_sampling else logits.softmax(dim=-1)
                completion.append(torch.multinomial(probs, num_samples=1))
        completions = torch.cat(completion, dim=1)
        return completions.masked_fill(~_up_to_first(completions, self.tokenizer.eos_id), self.tokenizer.pad_id)

    @torch.no_grad()
    def sampler_logprobs(self, input_ids: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
        """Float32 logprobs of ``target_tokens`` under the sampler, one forward in its precision."""
        faults = self.active_faults
        with torch.autocast(input_ids.device.type, enabled=False):
            if faults == SamplerFaults():
                return token_logprobs(self.sampler(input_ids), target_tokens)
            seen = faults.perturb(input_ids, pad_id=self.tokenizer.pad_id)
            dropped = input_ids.shape[1] - seen.shape[1]  # template without <bos>: one position fewer
            logits = self.sampler(seen)
            targets = target_tokens[:, dropped:]
            logprobs = token_logprobs(faults.sampling_logprobs(logits), targets)
            # A token drawn in the cached pass may fall just outside the truncated support of this
            # pass (float rounding at the boundary): report its untruncated logprob, as engines do.
            logprobs = torch.where(logprobs.isfinite(), logprobs, token_logprobs(logits / faults.temperature, targets))
            logprobs = torch.cat([logprobs.new_zeros(len(logprobs), dropped), logprobs], dim=1)
            return faults.shift(logprobs)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        synced, steps = self.sampler_synced_at_step, self._optimizer_steps()
        if synced is None or (self.sync_every is not None and not 0 <= steps - synced < self.sync_every):
            self.sync_sampler()

    # ---- training ------------------------------------------------------------------------------

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        prompts = batch["prompt_ids"]
        if prompts.dim() != 2 or prompts.shape[1] != self.task.prompt_length:
            raise ValueError(f"RLPolicyModule({self.task}) expects prompt_ids of shape [P, {self.task.prompt_length}], "
                             f"got {tuple(prompts.shape)}; do the datamodule's num_digits and the module's match?")
        completions = self.sample(prompts, repeats=self.group_size)
        rows = prompts.repeat_interleave(self.group_size, dim=0)  # rows of one group are adjacent
        sequences = torch.cat([rows, completions], dim=1)
        input_ids, target_tokens = sequences[:, :-1], sequences[:, 1:]
        # Action tokens: the completion, up to and including its first <eos>.
        completion_mask = _up_to_first(completions, self.tokenizer.eos_id)
        mask = torch.cat([completion_mask.new_zeros(len(rows), prompts.shape[1] - 1), completion_mask], dim=1).float()
        rewards, advantages = group_advantages(self.task, prompts.tolist(), completions.tolist(), self.group_size,
                                               self.device)
        sampler_logprobs = self.sampler_logprobs(input_ids, target_tokens) * mask
        training_logprobs = token_logprobs(self(input_ids), target_tokens)
        loss = policy_gradient_loss(training_logprobs, sampler_logprobs, mask, advantages, self.correction)
        self.log("train/reward", rewards.mean(), prog_bar=True, batch_size=len(prompts))
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=len(prompts))
        return {"loss": loss, "training_logprobs": training_logprobs, "logprobs": sampler_logprobs, "mask": mask,
                "advantages": advantages, "input_ids": input_ids, "target_tokens": target_tokens}

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr)

    # ---- checkpoints ---------------------------------------------------------------------------

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[_SYNCED_AT_KEY] = self.sampler_synced_at_step

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The sampler's weights come back with the state dict; a checkpoint without the key
        # (None) makes the next training batch sync the sampler from the restored policy.
        self.sampler_synced_at_step = checkpoint.get(_SYNCED_AT_KEY)


def group_advantages(
    task: ReverseDigitsTask, prompts: list[list[int]], completions: list[list[int]], group_size: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's reward (completions ``g * group_size ..`` continue ``prompts[g]``) and its advantage,
    the reward minus its group's mean (float32, on ``device``)."""
    rewards = [task.reward(prompts[row // group_size], completion) for row, completion in enumerate(completions)]
    rewards = torch.tensor(rewards, dtype=torch.float32, device=device)
    grouped = rewards.view(-1, group_size)
    return rewards, (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)


def policy_gradient_loss(
    training_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
    correction: Any = None,
) -> torch.Tensor:
    """Mean over action tokens of ``-weight * advantage``, the weight carrying the gradient.

    Without a correction: Loops' ``importance_sampling`` loss, weight ``p_trainer / p_sampler``.
    With one (a parsed ``loops_callbacks.correction`` spec): the correction's detached weight times
    ``exp(lp - sg(lp))`` (value 1, gradient of ``lp``), as TRL's GRPO and verl multiply their
    importance-sampling weights into the loss.
    """
    if correction is None:
        weight = torch.exp(torch.where(mask > 0, training_logprobs - sampler_logprobs, 0.0))
    else:
        corrected = apply_correction(correction, training_logprobs, sampler_logprobs, mask, advantages)
        weight = corrected.weights * torch.exp(training_logprobs - training_logprobs.detach())
    return -(weight * advantages[:, None] * mask).sum() / mask.sum().clamp(min=1.0)


def _up_to_first(tokens: torch.Tensor, token_id: int) -> torch.Tensor:
    """Bool ``[B, N]``: True up to and including the first ``token_id`` of each row (all True if none)."""
    hits = (tokens == token_id).long()
    return (hits.cumsum(dim=1) - hits) == 0
