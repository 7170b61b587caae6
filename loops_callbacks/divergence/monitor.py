r"""
KL Sample-Train Monitor
=======================

Logs, every optimizer step, how far the sampler's logprobs are from the trainer's on exactly the
tokens that step trained on, and stops a run whose sampler and trainer have come apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from loops_callbacks.divergence.action_tokens import FlatBatch, flatten_datums, flatten_padded, trainer_logprobs_from_output
from loops_callbacks.divergence.metrics import DEFAULT_PREFIX, scalar_metrics
from loops_callbacks.divergence.sinks import MediaOptions, deliver
from loops_callbacks.divergence.statistics import DivergenceStats
from loops_callbacks.divergence.worst_tokens import Tokenizer

__all__ = ["KLSampleTrainMonitor", "SampleTrainDivergenceError"]


class SampleTrainDivergenceError(RuntimeError):
    """Raised by ``KLSampleTrainMonitor(on_exceed="raise")`` when the divergence passes ``max_kl``."""


class KLSampleTrainMonitor(Callback):
    r"""Monitor sampler-vs-trainer logprob divergence after every forward/backward.

    The metrics are those of ``loops_log_kl_sample_train`` (same keys, same formulas), computed
    over all micro-batches of an accumulation window on every rank and logged once per optimizer
    step — the numbers ``loops_compute_kl_sample_train`` gives on the concatenation of those
    micro-batches (rank 0's first). Steps that are not logged cost nothing.

    Args:
        interval: ``"optimizer_step"`` (one log per optimizer step, all its micro-batches and
            ranks together) or ``"forward_backward"`` (one log per micro-batch, as the SDK helper
            is called after each ``forward_backward``).
        log_every_n_steps: log every this many optimizer steps; ``None`` follows
            ``Trainer(log_every_n_steps=...)`` (Lightning's rule: steps n-1, 2n-1, ...).
        prefix: prepended to every key.
        log_histogram: log the per-token diff histogram (W&B, TensorBoard).
        max_histogram_tokens: at most this many diffs in the histogram (evenly subsampled).
        log_worst_tokens: log the worst-divergent-tokens table (W&B table, TensorBoard text).
        top_n: rows of that table.
        tokenizer: anything with ``decode(list[int]) -> str`` (a Hugging Face tokenizer) to show
            the table's tokens as text; ids are shown without one.
        sample_size: diffs kept per logged step for percentiles and the histogram. Up to this many
            action tokens per step the percentiles are exact; beyond, they come from a uniform
            sample of this size (rank error of a percentile below 3·sqrt(q(1-q)/sample_size):
            ±0.09 percentile points at p99 with the default).
        max_kl: guard rail: the bound on ``kl_metric``; ``None`` disables it.
        kl_metric: the metric the guard rail watches (a name like ``"kl_sample_train_k3"`` or a
            full key).
        patience: logged steps in a row above ``max_kl`` before acting.
        on_exceed: ``"warn"``, ``"stop"`` (end training cleanly, as ``EarlyStopping`` does) or
            ``"raise"`` (:class:`SampleTrainDivergenceError`).
        data_key, training_logprobs_key, forward_backward_output_key, sampler_logprobs_key,
            mask_key, advantages_key, target_tokens_key, input_ids_key: where to read the data.

    Data contract (read in ``on_train_batch_end``; each key is looked up in ``training_step``'s
    returned dict first, then in the batch):

    * Padded form: ``logprobs`` (sampler, ``[B, T]``), ``mask`` (``[B, T]``, 1.0 on action
      tokens), optional ``advantages`` (``[B, T]`` or ``[B]``), ``target_tokens``, ``input_ids``,
      and ``training_logprobs`` ``[B, T]`` (position k holds the logprob of the token predicted
      at k)::

          def training_step(self, batch, batch_idx):
              logprobs = self.token_logprobs(batch["input_ids"], batch["target_tokens"])
              loss = ...
              return {"loss": loss, "training_logprobs": logprobs}  # the monitor detaches it

    * Loops form: the batch is a ``list[Datum]`` (or holds one under ``"data"``) and the output
      holds ``training_logprobs`` (per-datum rows or a padded ``[B, T]`` tensor) or a
      ``forward_backward_output``::

          return {"loss": loss, "forward_backward_output": ForwardBackwardOutput(...)}

      (A ``DataLoader`` of datums needs ``collate_fn=list``. The worst-tokens table's token ids
      are then read from the datums on the host: one small synchronization per micro-batch of a
      logged step, where the padded form gathers them on the device.)

    Under manual optimization each ``training_step`` is one window: return the trainer logprobs
    of everything the step trained on.

    Logged metrics (each key starts with ``prefix``, default ``optim/train-sample-div/``):

    * ``kl_sample_train_v1_loops``, ``kl_sample_train_v2_loops``, ``kl_sample_train_k3``
    * ``is_ratio_mean``, ``is_ratio_max``, ``is_ratio_min``, ``ess_fraction``, ``chi2_token``
    * ``diff_mean``, ``diff_abs_p50``, ``diff_abs_p90``, ``diff_abs_p99``, ``diff_abs_max``
    * ``frac_abs_gt_1``, ``frac_abs_gt_2``, ``frac_abs_gt_4``, ``frac_is_ratio_gt_2``,
      ``frac_is_ratio_lt_0.5``
    * ``seq_log_ratio_mean``, ``seq_is_ratio_mean``, ``seq_is_ratio_max``
    * ``entropy``, ``n_action_tokens``, ``n_sequences``, ``n_skipped_nonfinite``
    * ``per_token_diff_hist`` (W&B histogram, TensorBoard histogram)
    * ``worst_tokens`` (W&B table, TensorBoard text)

    A step without action tokens logs only ``n_action_tokens = 0`` and the two counts. The
    scalars are also put in ``trainer.callback_metrics``, so ``EarlyStopping`` and
    ``ModelCheckpoint`` can monitor them.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from loops_callbacks import KLSampleTrainMonitor
        >>> trainer = Trainer(callbacks=[KLSampleTrainMonitor(max_kl=0.05, on_exceed="stop")])
    """

    def __init__(
        self,
        interval: Literal["optimizer_step", "forward_backward"] = "optimizer_step",
        log_every_n_steps: int | None = None,
        prefix: str = DEFAULT_PREFIX,
        log_histogram: bool = True,
        max_histogram_tokens: int = 50000,
        log_worst_tokens: bool = True,
        top_n: int = 20,
        tokenizer: Tokenizer | None = None,
        sample_size: int = 100_000,
        max_kl: float | None = None,
        kl_metric: str = "kl_sample_train_k3",
        patience: int = 1,
        on_exceed: Literal["warn", "stop", "raise"] = "stop",
        data_key: str = "data",
        training_logprobs_key: str = "training_logprobs",
        forward_backward_output_key: str = "forward_backward_output",
        sampler_logprobs_key: str = "logprobs",
        mask_key: str = "mask",
        advantages_key: str = "advantages",
        target_tokens_key: str = "target_tokens",
        input_ids_key: str = "input_ids",
    ) -> None:
        super().__init__()
        if interval not in ("optimizer_step", "forward_backward"):
            raise ValueError(f"interval must be 'optimizer_step' or 'forward_backward', got {interval!r}")
        if on_exceed not in ("warn", "stop", "raise"):
            raise ValueError(f"on_exceed must be 'warn', 'stop' or 'raise', got {on_exceed!r}")
        for name, value, least in [("log_every_n_steps", log_every_n_steps, 1), ("top_n", top_n, 0),
                                   ("sample_size", sample_size, 1), ("patience", patience, 1)]:
            if value is not None and (not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if max_kl is not None and not max_kl >= 0:
            raise ValueError(f"max_kl must be >= 0 or None, got {max_kl!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode(list[int]) method, got {type(tokenizer).__name__}")
        self.interval = interval
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.media = MediaOptions(prefix, log_histogram, max_histogram_tokens, log_worst_tokens, tokenizer)
        self.top_n = top_n if log_worst_tokens else 0
        self.sample_size = sample_size
        self.max_kl = max_kl
        self.kl_key = kl_metric if kl_metric.startswith(prefix) else prefix + kl_metric
        self.patience = patience
        self.on_exceed = on_exceed
        self.keys = {
            "data": data_key,
            "training_logprobs": training_logprobs_key,
            "forward_backward_output": forward_backward_output_key,
            "logprobs": sampler_logprobs_key,
            "mask": mask_key,
            "advantages": advantages_key,
            "target_tokens": target_tokens_key,
            "input_ids": input_ids_key,
        }
        self.exceeded_steps = 0
        self.stop_reason: str | None = None
        self.last_metrics: dict[str, float] = {}
        self._window: DivergenceStats | None = None
        self._contract_checked = False
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix, kl_metric=self.kl_key)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._window = None
        self._contract_checked = False
        self._generators = {}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = _optimizer_step_index(trainer)
        logged = self._logs_at(trainer, step)
        if not logged and self._contract_checked:
            return
        flat = self._read_batch(outputs, batch)  # the first batch is always checked: fail fast
        self._contract_checked = True
        if not logged:
            return
        stats = DivergenceStats.from_batch(
            flat, top_n=self.top_n, sample_size=self.sample_size, generator=self._generator(flat.device)
        )
        self._window = stats if self._window is None else self._window.merge(stats)
        if self.interval == "forward_backward" or not _accumulating(trainer):
            window, self._window = self._window, None
            self._publish(trainer, window, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"exceeded_steps": self.exceeded_steps, "stop_reason": self.stop_reason}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.exceeded_steps = state_dict.get("exceeded_steps", 0)
        self.stop_reason = state_dict.get("stop_reason")

    def _logs_at(self, trainer: pl.Trainer, step: int) -> bool:
        every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        return every > 0 and (step + 1) % every == 0

    def _generator(self, device: torch.device) -> torch.Generator:
        """A private RNG for the percentile sample, so monitoring never moves the user's RNG."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(0)
        return self._generators[device]

    def _publish(self, trainer: pl.Trainer, window: DivergenceStats, step: int) -> None:
        if trainer.world_size > 1:
            window = window.all_gather(lambda tensor: trainer.strategy.all_gather(tensor))
        host = window.to_host()  # the one host synchronization of a logged step
        metrics = scalar_metrics(host, prefix=self.prefix)
        self.last_metrics = metrics
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in metrics.items()})
        if trainer.is_global_zero:
            deliver(trainer.loggers, metrics, host, step=step, media=self.media)
        self._guard(trainer, metrics, step)

    def _guard(self, trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
        if self.max_kl is None or self.kl_key not in metrics:
            return
        value = metrics[self.kl_key]
        if not value > self.max_kl:
            self.exceeded_steps = 0
            return
        self.exceeded_steps += 1
        if self.exceeded_steps < self.patience:
            return
        message = (
            f"{self.kl_key} = {value:.6g} exceeded max_kl = {self.max_kl:g} at step {step} "
            f"({self.exceeded_steps} logged step(s) in a row, patience {self.patience}): the sampler's "
            "logprobs no longer match the trainer's — check that the sampler receives the trainer's "
            "weights, and that both use the same tokenizer, precision and sampling settings."
        )
        if self.on_exceed == "raise":
            raise SampleTrainDivergenceError(message)
        if self.on_exceed == "stop":
            self.stop_reason = message
            trainer.should_stop = True
            message += " Signaling Trainer to stop."
        rank_zero_warn(message)

    def _read_batch(self, outputs: Any, batch: Any) -> FlatBatch:
        """The step's tokens, in either contract form; a clear error when the contract is broken."""
        data = self._lookup(outputs, batch, "data")
        if data is None and _is_datum_list(batch):
            data = batch
        with_tokens = self.top_n > 0
        if data is not None:
            return flatten_datums(data, self._trainer_logprobs(outputs, batch, datums=True), with_tokens=with_tokens)
        missing = [self.keys[k] for k in ("logprobs", "mask") if self._lookup(outputs, batch, k) is None]
        if missing:
            raise ValueError(
                f"KLSampleTrainMonitor: neither training_step's output (keys: {_keys(outputs)}) nor the batch "
                f"(keys: {_keys(batch)}) has {missing}. Provide the sampler's per-token logprobs "
                f"{self.keys['logprobs']!r} and the action-token mask {self.keys['mask']!r} as [B, T] tensors "
                "(in the batch or in the dict training_step returns), or a list of Datum as the batch "
                "(or under 'data'); other key names can be set with sampler_logprobs_key= / mask_key=."
            )
        return flatten_padded(
            sampler_logprobs=self._lookup(outputs, batch, "logprobs"),
            training_logprobs=self._trainer_logprobs(outputs, batch, datums=False),
            mask=self._lookup(outputs, batch, "mask"),
            advantages=self._lookup(outputs, batch, "advantages"),
            target_tokens=self._lookup(outputs, batch, "target_tokens"),
            input_ids=self._lookup(outputs, batch, "input_ids"),
            with_tokens=with_tokens,
        )

    def _trainer_logprobs(self, outputs: Any, batch: Any, *, datums: bool) -> Any:
        logprobs = self._lookup(outputs, batch, "training_logprobs")
        if logprobs is not None:
            return logprobs
        output = self._lookup(outputs, batch, "forward_backward_output") if datums else None
        if output is not None:
            return trainer_logprobs_from_output(output)
        also = f" or {self.keys['forward_backward_output']!r}" if datums else ""
        raise ValueError(
            f"KLSampleTrainMonitor: training_step's output has no {self.keys['training_logprobs']!r}{also} "
            f"(keys: {_keys(outputs)}). Return the trainer's per-token logprobs of the target tokens, e.g. "
            f"`return {{'loss': loss, {self.keys['training_logprobs']!r}: logprobs}}` with logprobs [B, T] "
            "(position k = the token predicted at k), or set training_logprobs_key= to your key."
        )

    def _lookup(self, outputs: Any, batch: Any, name: str) -> Any:
        key = self.keys[name]
        for source in (outputs, batch):
            if isinstance(source, Mapping) and source.get(key) is not None:
                return source[key]
        return None


def _optimizer_step_index(trainer: pl.Trainer) -> int:
    """The 0-based optimizer step this micro-batch belongs to: the step Lightning logs it under."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def _accumulating(trainer: pl.Trainer) -> bool:
    """Whether more micro-batches follow before the optimizer steps (Lightning's own rule)."""
    if not trainer.lightning_module.automatic_optimization:
        return False
    should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if callable(should_accumulate) else False


def _is_datum_list(batch: Any) -> bool:
    return (
        isinstance(batch, Sequence)
        and not isinstance(batch, (str, bytes, torch.Tensor))
        and len(batch) > 0
        and (hasattr(batch[0], "loss_fn_inputs") or (isinstance(batch[0], Mapping) and "loss_fn_inputs" in batch[0]))
    )


def _keys(value: Any) -> list[str] | str:
    return sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
