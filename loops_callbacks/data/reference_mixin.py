"""``ReferenceLogprobsMixin``: a ``LightningDataModule`` whose DPO pairs get reference logprobs before training.

The mixin reads the pairs once, in ``setup("fit")``: what ``dpo_data()`` returns (interleaved
datums, or pairs already packed) is checked into one ``PackedPairs`` (``check_dpo_pairs``), the
one form it keeps; the scored values join it as one float32 buffer, batches are cut from it
(``scored_pairs``), and datums come back from it only on request (``scored_pairs.datums()``: the
user's own datums, every field kept, with ``ref_logprobs`` attached).

The default reference is the policy itself (``PolicyReference``), scored in place in the
``on_fit_start`` hook: after the strategy has set the LightningModule up and before the first
optimizer step, so no copy of its weights ever exists. A resumed run (``fit(ckpt_path=...)``)
holds trained weights: it takes the initial policy's values from the cache, never from the module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from loops_callbacks import run_warnings
from loops_callbacks.data.dpo import check_dpo_pairs
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.reference.across_ranks import ReferenceCacheWarning, ReferenceLogprobsReport, score_across_ranks
from loops_callbacks.distributed import ProcessGroup, StallGuard, fail_together
from loops_callbacks.reference.config import ReferenceConfig, resolve_reference
from loops_callbacks.reference.policy import PolicyReference, policy_tag

__all__ = ["ReferenceLogprobsMixin"]


# Where a ReferenceLogprobsMixin is: setup("fit") checks the data ("pending"), scoring attaches the values ("scored").
# "awaiting restore": checked, under a strategy that restores checkpoints after on_fit_start (FSDP, model parallel,
# DeepSpeed), where that hook cannot know whether a checkpoint follows: scored in on_load_checkpoint when the run
# resumes, else on the first read of scored_pairs.
Stage = Literal["not set up", "pending", "awaiting restore", "scored"]


class _ScoreReferenceAfterStrategySetup(Callback):
    """Scores a ``ReferenceLogprobsMixin``'s default reference (the policy) once the strategy has set it up.

    ``on_fit_start`` runs after ``strategy.setup`` (device, DDP, FSDP sharding, ``configure_model``),
    before the sanity check and any dataloader; a checkpoint's state is restored before it, except
    under a strategy that restores after its setup (stage ``"awaiting restore"``): a resumed run there is
    scored in ``on_load_checkpoint``, once the DataModule's state is back.
    """

    def __init__(self, datamodule: ReferenceLogprobsMixin) -> None:
        self.datamodule = datamodule

    @property
    @override
    def state_key(self) -> str:
        return f"{type(self).__qualname__}[{type(self.datamodule).__qualname__}]"

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.strategy.restore_checkpoint_after_setup:
            self.datamodule._stage = "awaiting restore"  # a checkpoint may still come
        else:
            self.datamodule.score_reference()

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.datamodule._stage == "awaiting restore":
            self.datamodule.score_reference()


class ReferenceLogprobsMixin:
    """Attach reference logprobs to a ``LightningDataModule``'s DPO data once, before training.

    Put it before ``LightningDataModule`` in the bases, call ``configure_reference`` in
    ``__init__`` (declare its arguments in your ``__init__`` to set them from YAML), return the
    interleaved datums (chosen at even indices, rejected at odd) or packed pairs
    (``preference_pairs``, no datum at all) from ``dpo_data``, and read ``self.scored_pairs`` in
    ``train_dataloader`` / ``val_dataloader`` (``DPOPairDataset(self.scored_pairs)``). Call
    ``super().__init__()``, ``super().setup(stage)`` if you override ``setup``, and ``super()`` in
    ``state_dict`` / ``load_state_dict`` if you override them.

    ``setup("fit")`` checks the data (stage ``"pending"``), then ``score_reference()`` loads the
    reference logprobs from the cache or scores them (each rank its share of the pairs,
    ``score_across_ranks``; stage ``"scored"``). It runs:

    - for an explicit reference, in ``setup("fit")`` (a checkpoint is loaded into a copy of the
      LightningModule before the strategy moves, wraps or shards it);
    - for the default reference (``reference=None``), the LightningModule itself, in the
      ``on_fit_start`` hook (a callback the mixin adds to the trainer in ``setup("fit")``): after
      the strategy has set the module up, before the sanity check, any dataloader and the first
      optimizer step, so the initial policy is scored in place with no copy of its weights. Its
      ``forward(input_ids)`` must return logits ``[B, T, V]`` (or an object with ``.logits``);
    - without a trainer (``setup("fit")`` called by hand), in ``setup("fit")``.

    ``scored_pairs`` only reads: before scoring it is a ``RuntimeError``. Every checkpoint records
    the initial policy's fingerprint (``state_dict``); a resumed run takes the values from the cache
    that matches it, and a missing or mismatching cache is a ``ReferenceCacheError`` that names the
    fix. ``validate`` / ``test`` after ``fit`` keep the scored data. The cache lives in ``cache_dir``
    (default ``<trainer.default_root_dir>/reference_logprobs``), one file per reference, data and
    scoring dtype; see and prune the caches with ``loops-callbacks cache list|prune DIR``.

    Example::

        class MyData(ReferenceLogprobsMixin, L.LightningDataModule):
            def __init__(self, reference: str | None = None, cache_dir: str | None = None):
                super().__init__()
                self.configure_reference(reference, cache_dir=cache_dir)

            def dpo_data(self):
                return [*dpo_pair_datums([1, 5, 6], [1, 5, 7], prompt_length=2)]

            def train_dataloader(self):
                return DataLoader(DPOPairDataset(self.scored_pairs), batch_size=8, collate_fn=collate_dpo_pairs)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reference_config = ReferenceConfig()
        self._stage: Stage = "not set up"
        self._pairs: PackedPairs | None = None
        self._report: ReferenceLogprobsReport | None = None
        self._saved: dict[str, Any] | None = None  # what checkpoints record: the initial policy's fingerprint
        self._restored: dict[str, Any] | None = None  # what a checkpoint gave back

    def configure_reference(self, reference: Any = None, **settings: Any) -> None:
        """Set how the reference logprobs are scored and cached: ``reference`` and the other ``ReferenceConfig``
        fields (``cache_dir``, ``use_cache``, ``scoring_dtype``, ``max_tokens_per_batch``,
        ``reference_fingerprint``, ``progress``, ``check_prompts``, ``scoring_timeout``), checked here."""
        self._reference_config = ReferenceConfig(reference=reference, **settings)

    @property
    def reference_config(self) -> ReferenceConfig:
        """The settings ``configure_reference`` made (the defaults when it was not called)."""
        return self._reference_config

    @property
    def reference_report(self) -> ReferenceLogprobsReport | None:
        """What the last scoring did (loaded or scored, how many datums here, how long)."""
        return self._report

    def dpo_data(self) -> Sequence[Any] | PackedPairs:
        """The interleaved DPO pairs to score: datums (chosen at even indices, rejected at odd), or ``PackedPairs``."""
        raise NotImplementedError(f"{type(self).__name__} must define dpo_data() returning the interleaved datums")

    @property
    def scored_pairs(self) -> PackedPairs:
        """The checked pairs with their reference values, the form batches are cut from: ``DPOPairDataset(self.scored_pairs)``.

        Available once scored: read it in a dataloader hook. Under a strategy that restores
        checkpoints after its setup (FSDP, ...) and without a checkpoint, the first read scores the
        policy (no hook comes between that restore and the dataloaders).
        """
        if self._stage == "awaiting restore":  # no checkpoint came: the restore is over
            self.score_reference()
        if self._stage == "scored":
            assert self._pairs is not None
            return self._pairs
        if self._stage == "pending":
            raise RuntimeError(f"{type(self).__name__}.scored_pairs was read before the strategy set the "
                               "LightningModule up: with the default reference (the policy itself) it is scored in "
                               "on_fit_start; read it in train_dataloader / val_dataloader, not in setup")
        raise RuntimeError(f"{type(self).__name__}.scored_pairs is computed in setup('fit'); run trainer.fit, or "
                           "call setup('fit')")

    @property
    def num_dpo_pairs(self) -> int:
        """How many pairs ``setup("fit")`` checked (known before the reference logprobs are)."""
        if self._pairs is None:
            raise RuntimeError(f"{type(self).__name__}.num_dpo_pairs is known after setup('fit')")
        return len(self._pairs) // 2

    def setup(self, stage: str) -> None:
        super().setup(stage)  # type: ignore[misc]
        if stage != "fit":
            return
        self._stage, self._pairs, self._report, self._saved = "not set up", None, None, None
        config = self._reference_config
        with fail_together(StallGuard(ProcessGroup(), config.scoring_timeout), "checking the DPO pairs",
                           then="the end of checking the DPO pairs"):
            pairs = check_dpo_pairs(self.dpo_data(), check_prompts=config.check_prompts)  # before any reference
        self._pairs, self._stage = pairs, "pending"
        trainer = getattr(self, "trainer", None)
        if trainer is None or config.reference is not None:
            self.score_reference()
        elif not any(isinstance(c, _ScoreReferenceAfterStrategySetup) and c.datamodule is self
                     for c in trainer.callbacks):
            trainer.callbacks.append(_ScoreReferenceAfterStrategySetup(self))

    def score_reference(self) -> ReferenceLogprobsReport:
        """Load or score the reference logprobs of the pairs ``setup("fit")`` checked (on every rank at once).

        Called for you (see the class docstring); with the default reference, the strategy must
        have set the LightningModule up. A second call returns the first one's report.
        """
        if self._stage == "not set up":
            raise RuntimeError(f"{type(self).__name__}.score_reference needs setup('fit') first")
        if self._stage != "scored":
            assert self._pairs is not None
            trainer = getattr(self, "trainer", None)
            config = self._reference_config
            root = trainer.default_root_dir if trainer is not None else os.getcwd()
            config = replace(config, cache_dir=config.cache_dir or os.path.join(root, "reference_logprobs"))
            if config.reference is None and trainer is not None:
                values, self._report = self._score_policy(trainer, config)
            else:
                values, self._report = self._score_explicit(trainer, config)
            self._pairs, self._stage = self._pairs.scored(values), "scored"
        assert self._report is not None
        return self._report

    def state_dict(self) -> dict[str, Any]:
        """Lightning saves this in checkpoints: with the default reference, the initial policy's fingerprint."""
        state = dict(super().state_dict())  # type: ignore[misc]
        if self._saved:
            state["reference_logprobs"] = dict(self._saved)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores this before ``on_fit_start`` (after it under FSDP / model parallel / DeepSpeed)."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        restored = state_dict.get("reference_logprobs")
        self._restored = dict(restored) if isinstance(restored, dict) else None

    def _score(self, reference: Any, config: ReferenceConfig, **how: Any) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """``score_across_ranks`` on the checked pairs: a pair's two sequences on one rank, errors naming the pair."""
        assert self._pairs is not None
        return score_across_ranks(self._pairs.tokens, reference, config, datums=self._pairs.source, shard_unit=2,
                                  datum_name=self._pairs.label, **how)

    def _score_explicit(self, trainer: Any, config: ReferenceConfig) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """A reference other than the policy: resolved (a copy, a client, a callable) from ``config`` and scored now."""
        client = resolve_reference(config.reference, config=config,
                                   lightning_module=trainer.lightning_module if trainer is not None else None,
                                   device=trainer.strategy.root_device if trainer is not None else None)
        try:
            return self._score(client, config)
        finally:
            del client
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _score_policy(self, trainer: Any, config: ReferenceConfig) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """The default reference: the policy as the strategy has set it up, or, on a resumed run, the cache."""
        tag = policy_tag(trainer, config.scoring_dtype)
        with torch.inference_mode(False):
            if trainer.ckpt_path is not None:
                values, report = self._load_initial_policy(trainer, config, tag)
            else:
                policy = PolicyReference.from_trainer(trainer, scoring_dtype=config.scoring_dtype,
                                                      max_tokens_per_batch=config.max_tokens_per_batch)
                # the policy's weights are fingerprinted: a reference_fingerprint names a client's
                values, report = self._score(policy, replace(config, reference_fingerprint=None), cache_tag=tag)
        self._saved = {"reference_fingerprint": report.reference_fingerprint, "scoring_dtype": tag}
        return values, report

    def _load_initial_policy(self, trainer: Any, config: ReferenceConfig,
                             tag: str) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """A resumed run: the module holds trained weights, so the initial policy's values come from the cache."""
        expected = (self._restored or {}).get("reference_fingerprint")
        if expected is None:
            run_warnings.warn(f"the checkpoint {trainer.ckpt_path!r} does not record which initial policy the "
                              "reference logprobs came from (saved by another DataModule or version): the cached "
                              "values of these data are used whichever reference made them", ReferenceCacheWarning)
        which = f" (weights fingerprint {expected[:16]}...)" if expected else ""
        where = (f"restore the first run's cache file in {config.cache_dir} (or point cache_dir at the directory "
                 "holding it)" if config.use_cache else "run with use_cache=True and the first run's cache_dir")
        fix = (f"this run resumes from {trainer.ckpt_path}, so the LightningModule holds trained weights, not the "
               f"initial policy{which} whose logprobs are the DPO reference; they can only come from the cache the "
               f"first run wrote: {where}, or pass reference=<a checkpoint of the initial policy, saved before the "
               "first optimizer step> (a checkpoint is loaded into a copy of the module, so a model built in "
               "configure_model needs the cache file)")
        # the initial policy's fingerprint, as the checkpoint recorded it
        return self._score(None, replace(config, reference_fingerprint=expected), cache_tag=tag, cache_only_reason=fix)
