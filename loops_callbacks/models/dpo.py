"""DPO against attached reference logprobs: the loss, a base LightningModule, and one for any Hugging Face causal LM.

A batch (as ``loops_callbacks.data.DPODataModule`` builds it) is a dict of ``[2P, T]`` tensors,
rows interleaved (row 2i = pair i's chosen sequence, row 2i+1 its rejected one), right-padded
with 0:

- ``input_ids``: the full sequence (the datum's ``model_input``);
- ``target_tokens``: ``target_tokens[k] = input_ids[k + 1]`` (position k belongs to the token
  predicted at k; the last position predicts nothing);
- ``weights``: 1.0 on completion positions, 0.0 on prompt, padding and the last position;
- ``ref_logprobs``: the reference model's logprobs, same positions;
- ``attention_mask``: True on real tokens (not needed: attention is causal and padding is on the
  right, so the logits of real positions do not depend on it).

With ``pi`` and ``ref`` the weighted sums of the policy's and the reference's logprobs over a
row, the loss of pair i is ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` (TRL's
``sigmoid`` loss). Logged: ``{train,val}/dpo_loss``, ``dpo_accuracy`` (share of pairs with a
positive margin), ``dpo_margin`` (chosen minus rejected reward), ``chosen_reward`` and
``rejected_reward`` (``beta * (pi - ref)``): ``train/*`` are means over the step's pairs (rank
0's under DDP, no collective per step), ``val/*`` means over every held-out pair of every rank
(sums over pairs and pair counts added up across ranks at the end of the validation epoch).

Examples:
    >>> import torch
    >>> logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    >>> loss, metrics = dpo_loss(logprobs, torch.full((2, 2), -1.5), torch.ones(2, 2), beta=0.5)
    >>> round(loss.item(), 4), metrics["dpo_accuracy"].item(), metrics["dpo_margin"].item()
    (0.3133, 1.0, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from jsonargparse.typing import PositiveFloat
from lightning.pytorch import LightningModule
from typing_extensions import override

from loops_callbacks.data.tokenizer import check_tokenizer_path, load_tokenizer
from loops_callbacks.logprobs import token_logprobs
from loops_callbacks.optional import import_optional
from loops_callbacks.validation import check, check_real

__all__ = ["DPOModule", "HFDPOModule", "dpo_loss"]

_REQUIRED_KEYS = ("input_ids", "target_tokens", "weights")
_METRIC_NAMES = ("dpo_loss", "dpo_accuracy", "dpo_margin", "chosen_reward", "rejected_reward")
"""The metrics ``dpo_loss`` returns, logged as ``train/<name>`` and ``val/<name>``."""
_PROGRESS_BAR = ("dpo_loss", "dpo_accuracy")


def dpo_loss(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, weights: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO loss of interleaved rows, and its metrics (detached, means over pairs).

    Args:
        policy_logprobs: ``[2P, T]`` policy logprobs of the target tokens.
        ref_logprobs: ``[2P, T]`` reference logprobs (values where ``weights`` is 0 are ignored,
            even NaN).
        weights: ``[2P, T]`` per-position weights, 1.0 on completion tokens.
        beta: the DPO temperature.

    Returns:
        ``(loss, metrics)`` with metrics ``dpo_loss``, ``dpo_accuracy``, ``dpo_margin``,
        ``chosen_reward``, ``rejected_reward``.
    """
    if not (policy_logprobs.shape == ref_logprobs.shape == weights.shape) or policy_logprobs.dim() != 2:
        raise ValueError(f"dpo_loss needs [2P, T] tensors of one shape, got policy_logprobs "
                         f"{tuple(policy_logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)}, weights "
                         f"{tuple(weights.shape)}")
    if policy_logprobs.shape[0] % 2:
        raise ValueError(f"dpo_loss needs interleaved chosen/rejected rows, got an odd number of rows: "
                         f"{policy_logprobs.shape[0]}")
    active = weights != 0
    weights = weights.to(policy_logprobs.dtype)
    policy = (torch.where(active, policy_logprobs, 0.0) * weights).sum(dim=1)
    reference = (torch.where(active, ref_logprobs.to(policy.dtype), 0.0) * weights).sum(dim=1)
    rewards = beta * (policy - reference)
    chosen_reward, rejected_reward = rewards[0::2], rewards[1::2]
    margin = chosen_reward - rejected_reward
    loss = -F.logsigmoid(margin).mean()
    metrics = {"dpo_loss": loss.detach(), "dpo_accuracy": (margin > 0).float().mean(),
               "dpo_margin": margin.detach().mean(), "chosen_reward": chosen_reward.detach().mean(),
               "rejected_reward": rejected_reward.detach().mean()}
    return loss, metrics


class DPOModule(LightningModule):
    """DPO on batches of interleaved pairs with attached reference logprobs; subclasses provide the policy.

    A subclass builds its model in ``__init__`` and defines ``forward(input_ids) -> logits
    [B, T, V]``; that also lets ``DPODataModule`` score the reference with the module itself before
    its first step (the usual "reference = initial policy", with no copy of the weights). Training
    and validation steps, the metrics and AdamW over the trainable parameters are here; ``val/*``
    are logged in ``on_validation_epoch_end`` (a subclass overriding it calls ``super()``).

    Args:
        beta: the DPO temperature (how far from the reference the policy may move).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(self, beta: PositiveFloat = 0.1, lr: PositiveFloat = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__()
        owner = type(self).__name__
        self.beta = check_real(f"{owner} beta", beta, least=math.ulp(0.0), what="a positive number")
        self.lr = check_real(f"{owner} lr", lr, least=math.ulp(0.0), what="a positive number")
        self.weight_decay = check_real(f"{owner} weight_decay", weight_decay, least=0.0, what="a number >= 0")
        self._val_totals: torch.Tensor | None = None  # see validation_step

    def policy_logprobs(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[2P, T]`` float32 policy logprobs of ``batch["target_tokens"]`` (with grad)."""
        return token_logprobs(self(batch["input_ids"]), batch["target_tokens"])

    @override
    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, metrics, num_pairs = self._loss_and_metrics(batch)
        for name, value in metrics.items():
            self.log(f"train/{name}", value, prog_bar=name in _PROGRESS_BAR, batch_size=num_pairs)
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        self._val_totals = None

    @override
    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The same loss and metrics on held-out pairs (``DPODataModule(val_fraction=...)``), as ``val/*``."""
        loss, metrics, num_pairs = self._loss_and_metrics(batch)
        totals = self._val_totals if self._val_totals is not None else self._zero_totals()
        means = torch.stack([metrics[name] for name in _METRIC_NAMES]).to(totals.dtype)
        self._val_totals = totals + torch.cat([means * num_pairs, means.new_tensor([num_pairs])])
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        """``val/*``: every rank's sums over pairs and pair count, added up by one all-reduce, then divided.

        (Lightning 2.6's own ``sync_dist`` averages the pair counts as integers, a truncated mean
        when the ranks hold an odd number of pairs in all: Lightning-AI/pytorch-lightning#21859.)
        A rank that validated nothing adds zeros.
        """
        totals = self._val_totals if self._val_totals is not None else self._zero_totals()
        self._val_totals = None
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        if totals[-1] == 0:
            return
        for name, value in zip(_METRIC_NAMES, (totals[:-1] / totals[-1]).float()):
            # equal on every rank already; Lightning's mean of equal values (sync_dist, so that it
            # does not warn about an unsynchronised epoch metric) leaves them as they are
            self.log(f"val/{name}", value, prog_bar=name in _PROGRESS_BAR, batch_size=1, sync_dist=True)

    def _loss_and_metrics(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """The loss, the metrics and the number of pairs of a batch, checked first (``ref_logprobs``, one shape)."""
        name = type(self).__name__
        if "ref_logprobs" not in batch:
            raise ValueError(f"{name}: the batch has no 'ref_logprobs' - the reference logprobs were not attached. "
                             "Score every datum with a frozen reference model before training: use "
                             "loops_callbacks.data.DPODataModule (it attaches them), or call "
                             "loops_callbacks.attach_reference_logprobs(datums, reference) on the datums the batches "
                             f"are built from. The batch has keys {sorted(batch)}.")
        missing = [key for key in _REQUIRED_KEYS if key not in batch]
        if missing:
            raise ValueError(f"{name}: the batch lacks {missing}; it has keys {sorted(batch)}")
        shapes = {key: tuple(batch[key].shape) for key in (*_REQUIRED_KEYS, "ref_logprobs")}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"{name}: batch fields must share one [2P, T] shape, got {shapes}")
        loss, metrics = dpo_loss(self.policy_logprobs(batch), batch["ref_logprobs"], batch["weights"], self.beta)
        return loss, metrics, batch["input_ids"].shape[0] // 2

    def _zero_totals(self) -> torch.Tensor:
        """One sum per metric, then the pair count (float64 where the device has it)."""
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        return torch.zeros(len(_METRIC_NAMES) + 1, dtype=dtype, device=self.device)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        parameters = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(parameters, lr=self.lr, weight_decay=self.weight_decay)


class HFDPOModule(DPOModule):
    """DPO on any Hugging Face causal LM: a checkpoint, or a randomly initialised model from a config.

    Args:
        model: a checkpoint's name or path (``AutoModelForCausalLM.from_pretrained``; its tokenizer
            is the data's default), or a dict for a randomly initialised model: either
            ``{"config": {"model_type": "llama", ...}, "tokenizer": name_or_path}`` or the config
            dict alone (then give the DataModule a ``tokenizer``). A config without
            ``vocab_size`` takes the tokenizer's size.
        beta, lr, weight_decay: see ``DPOModule`` (TRL's defaults: beta 0.1, lr 1e-6).
        from_pretrained_kwargs: more ``from_pretrained`` arguments (``revision``,
            ``attn_implementation``, ``dtype``, ...).

    Use the Trainer's ``precision`` (``bf16-mixed``, ``bf16-true``) for lower precision. The
    reference, by default, is this module itself, scored before the first step (no copy).

    Example::

        model:
          class_path: loops_callbacks.models.HFDPOModule
          init_args:
            model: Qwen/Qwen2.5-0.5B-Instruct
            beta: 0.1
            lr: 1.0e-6
    """

    def __init__(self, model: str | dict[str, Any], beta: PositiveFloat = 0.1, lr: PositiveFloat = 1e-6,
                 weight_decay: float = 0.0, from_pretrained_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(beta=beta, lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        transformers = import_optional("transformers", "HFDPOModule")
        self.tokenizer_name_or_path: str | None
        if isinstance(model, str):
            self.tokenizer_name_or_path = model
            self.model = transformers.AutoModelForCausalLM.from_pretrained(model, **(from_pretrained_kwargs or {}))
        elif isinstance(model, Mapping):
            config, self.tokenizer_name_or_path = _config_and_tokenizer(model)
            if "model_type" not in config:
                raise ValueError(f"HFDPOModule model config {sorted(config)} has no 'model_type' (e.g. 'llama', "
                                 "'qwen2', 'gpt2')")
            if self.tokenizer_name_or_path is not None:  # a missing path now, not when the data are read
                check_tokenizer_path(self.tokenizer_name_or_path, "HFDPOModule model['tokenizer']")
            if "vocab_size" not in config and self.tokenizer_name_or_path is not None:
                config["vocab_size"] = len(load_tokenizer(self.tokenizer_name_or_path))
            model_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
            self.model = transformers.AutoModelForCausalLM.from_config(model_config)
        else:
            raise TypeError(f"HFDPOModule model must be a checkpoint name/path or a config dict, got {type(model).__name__}")

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids must be below it)."""
        return int(self.model.config.vocab_size)

    @override
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The policy's logits ``[B, T, V]`` (causal attention; right padding does not change real positions)."""
        return self.model(input_ids=input_ids, use_cache=False).logits


def _config_and_tokenizer(model: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A copy of the model's config (the dict itself, or its ``"config"``), and its ``"tokenizer"`` if any."""
    if "config" not in model:
        return dict(model), None
    unknown = sorted(set(model) - {"config", "tokenizer"})
    if unknown or not isinstance(model["config"], Mapping):
        raise ValueError(f"HFDPOModule model: a dict is a config ({{'model_type': ...}}) or {{'config': {{...}}, "
                         f"'tokenizer': name_or_path}}; got keys {sorted(model)}")
    tokenizer = check("HFDPOModule model['tokenizer']", model.get("tokenizer"), str, "a name or path", optional=True)
    return dict(model["config"]), tokenizer
