"""``ReferenceLogprobsMixin``: a ``LightningDataModule`` whose DPO pairs get reference logprobs before training.

``compute_reference_logprobs`` is the same for any process group, outside Lightning: it checks the
pairs (``check_dpo_pairs``: an even number of datums, no empty sequence, matching chosen/rejected
prompts, field lengths, each ``ValueError`` naming the pair) and hands their packed token ids to
``loops_callbacks.reference.across_ranks.score_packed_across_ranks`` (the ids checked once against the
reference's vocabulary, naming the pair, before anything is scored; cache, shards, gather).

The mixin reads the pairs once, into one ``PackedPairs`` (``dpo_pairs()`` checked by
``check_packed_pairs``, or ``dpo_data()``'s datums read by ``check_dpo_pairs``), and keeps only
that: the scored values join it as one buffer, batches are cut from it, and datums are made from it
only when ``scored_data`` is read (or, while scoring, for a remote client that scores datums).

The default reference is the policy itself (``PolicyReference``), scored in place in the
``on_fit_start`` hook: after the strategy has set the LightningModule up and before the first
optimizer step, so no copy of its weights ever exists. A resumed run (``fit(ckpt_path=...)``)
holds trained weights: it takes the initial policy's values from the cache, never from the module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from loops_callbacks import run_warnings
from loops_callbacks.data.dpo import check_dpo_pairs, check_packed_pairs
from loops_callbacks.data.labels import datum_label
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.reference.across_ranks import (
    ReferenceCacheWarning,
    ReferenceLogprobsReport,
    score_packed_across_ranks,
)
from loops_callbacks.reference.attach import attach_reference_values
from loops_callbacks.reference.cache import CACHE_FILE_NAME
from loops_callbacks.reference.collectives import Group, StallGuard, fail_together
from loops_callbacks.reference.config import DEFAULT_SCORING_TIMEOUT, ReferenceConfig, ScoringDtype, ScoringOptions
from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.reference.policy import PolicyReference, policy_tag
from loops_callbacks.reference.resolve import resolve_reference

__all__ = [
    "ReferenceConfig",
    "ReferenceLogprobsMixin",
    "ReferenceScoring",
    "ScoringDtype",
    "Stage",
    "compute_reference_logprobs",
    "pair_scoring_options",
]

def compute_reference_logprobs(
    data: Sequence[Any],
    reference: Any,
    config: ReferenceConfig | None = None,
    *,
    cache_path: str | os.PathLike[str] | None = None,
    cache_tag: str | None = None,
    validated_tokens: list[list[int]] | None = None,
    cached_only: str | None = None,
) -> tuple[list[Any], ReferenceLogprobsReport]:
    """``attach_reference_logprobs(data, reference)``, scored once across ranks and cached on disk.

    Call it on every rank of an initialized ``torch.distributed`` group (or in a single process)
    with the same ``data``; the pairs are checked (``check_dpo_pairs``), then scored by
    ``score_across_ranks``, which checks the token ids against the reference's vocabulary once:
    each rank scores one contiguous block of pairs with about 1/world_size of the tokens, and all
    get every result. Without a ``cache_path``, or without a fingerprint for ``reference`` (a
    client with no ``fingerprint()`` method and no ``reference_fingerprint`` given), nothing is cached.

    Args:
        data: interleaved DPO datums (chosen at even indices, rejected at odd).
        reference: a ``SamplingClient``; a ``TorchSamplingClient`` whose weights differ across
            ranks is given rank 0's weights first (as DDP does to the policy).
        config: the scoring settings (``ReferenceConfig``; its ``reference_fingerprint`` is the
            reference's identity when ``reference`` has no ``fingerprint()``, e.g. the checkpoint
            path a remote sampler serves; ``progress``, ``check_prompts``, ``scoring_timeout``).
        cache_path: the cache's base path: each key's file lies beside it (``cache_file``; found and
            written by rank 0, read into memory by every rank).
        cache_tag: the cache key's tag, what the values depend on besides the weights and the data
            (default ``config.cache_tag()``: the scoring dtype, or ``"model"``).
        validated_tokens: what ``validate_dpo_pairs(data)`` returned, when the caller has checked
            ``data`` already (it is not checked again).
        cached_only: the values must come from the cache (nothing is scored; ``reference`` may be
            ``None``); the text ends the ``ReferenceCacheError`` of a miss (see ``score_across_ranks``).

    Ranks whose datums differ stop with a ``RanksDisagreeError`` naming the first differing pair,
    before anything is scored or cached.

    Returns:
        The new datums (in ``data``'s order) and a ``ReferenceLogprobsReport``.

    Example:
        >>> from loops_callbacks.data.dpo import dpo_pair_datums
        >>> class Flat:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-0.5] * (prompt.length - 1)
        >>> data = list(dpo_pair_datums([1, 5, 6], [1, 5, 7], prompt_length=2))
        >>> scored, report = compute_reference_logprobs(data, Flat(), ReferenceConfig(progress=False))
        >>> scored[1].loss_fn_inputs["ref_logprobs"].tolist(), report.cache_status
        ([-0.5, -0.5, 0.0], 'off')
    """
    data = list(data)
    config = config if config is not None else ReferenceConfig()
    if validated_tokens is not None:
        tokens = PackedTokens.from_sequences(validated_tokens)
    else:
        tokens = check_dpo_pairs(data, check_prompts=config.check_prompts).tokens
    options = pair_scoring_options(config, cache_path, cache_tag=cache_tag, cached_only=cached_only)
    values, report = score_packed_across_ranks(tokens, reference, options, datums=data)
    return attach_reference_values(data, values, tokens.offsets), report


def pair_scoring_options(
    config: ReferenceConfig,
    cache_path: str | os.PathLike[str] | None,
    *,
    cache_tag: str | None = None,
    cached_only: str | None = None,
) -> ScoringOptions:
    """``config``'s ``ScoringOptions`` for interleaved DPO pairs: a pair's two sequences on one rank, and errors
    that name the pair (``datum_label``).

    Example:
        >>> options = pair_scoring_options(ReferenceConfig(scoring_dtype="float16"), None)
        >>> options.shard_unit, options.cache_tag, options.datum_name(3)
        (2, 'float16', 'pair 1: the rejected datum (index 3)')
    """
    return config.scoring_options(
        cache_path=cache_path, cache_tag=cache_tag, cached_only=cached_only, shard_unit=2, datum_name=datum_label
    )


class Stage(Enum):
    """Where a ``ReferenceLogprobsMixin`` is: ``setup("fit")`` checks the data (``PENDING``), scoring attaches
    the values (``SCORED``).

    ``AFTER_RESTORE``: checked, under a strategy that restores checkpoints after ``on_fit_start``
    (FSDP, model parallel, DeepSpeed), where that hook cannot know whether a checkpoint follows:
    scored in ``on_load_checkpoint`` when the run resumes, else on the first read of ``scored_data``.
    """

    NOT_SET_UP = "not set up"
    PENDING = "pending"
    AFTER_RESTORE = "after the strategy's restore"
    SCORED = "scored"


@dataclass
class ReferenceScoring:
    """A ``ReferenceLogprobsMixin``'s whole state: its settings, its stage, and what each stage made.

    ``pairs`` are the checked pairs, packed (``check_dpo_pairs``), to which scoring adds ``values``
    (one float32 buffer, every sequence's ``ref_logprobs`` back to back) when ``SCORED``, with
    ``report``; ``datums`` are ``dpo_data()``'s own datums when the pairs came from it (kept by
    reference: a remote client scores them, and ``scored_data`` attaches the values to them, so no
    field of the user's is dropped); ``scored``, the datums with the values attached, is made on the
    first read of ``scored_data`` only (from ``datums``, else from ``pairs``); ``saved``
    is what checkpoints record (the initial policy's fingerprint) and ``restored`` what a checkpoint
    gave back (``load_state_dict``).
    """

    config: ReferenceConfig = field(default_factory=ReferenceConfig)
    stage: Stage = Stage.NOT_SET_UP
    pairs: PackedPairs | None = None
    datums: list[Any] | None = None
    scored: list[Any] | None = None
    report: ReferenceLogprobsReport | None = None
    saved: dict[str, Any] | None = None
    restored: dict[str, Any] | None = None

    @property
    def values(self) -> np.ndarray | None:
        """The scored values (``pairs.ref_logprobs``), ``None`` until ``SCORED``."""
        return self.pairs.ref_logprobs if self.pairs is not None else None


class _ScoreReferenceAfterStrategySetup(Callback):
    """Scores a ``ReferenceLogprobsMixin``'s default reference (the policy) once the strategy has set it up.

    ``on_fit_start`` runs after ``strategy.setup`` (device, DDP, FSDP sharding, ``configure_model``),
    before the sanity check and before any dataloader is asked for; a checkpoint's state is restored
    before it, except under a strategy that restores after its setup (FSDP, model parallel,
    DeepSpeed), where ``on_fit_start`` cannot know whether a checkpoint follows (``Stage.AFTER_RESTORE``):
    a resumed run there is scored in ``on_load_checkpoint``, once the DataModule's state is back.
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
            self.datamodule._reference.stage = Stage.AFTER_RESTORE  # a checkpoint may still come
            return
        self.datamodule.score_reference()

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.datamodule.reference_stage is Stage.AFTER_RESTORE:
            self.datamodule.score_reference()


class ReferenceLogprobsMixin:
    """Attach reference logprobs to a ``LightningDataModule``'s DPO data once, before training.

    Put it before ``LightningDataModule`` in the bases, call ``configure_reference`` in
    ``__init__`` (declare its arguments in your ``__init__`` to set them from YAML), return the
    interleaved datums (chosen at even indices, rejected at odd) from ``dpo_data`` (or the packed
    pairs from ``dpo_pairs``, which makes no datum: ``preference_pairs``, ``check_dpo_pairs``), and read
    ``self.scored_pairs`` (the packed form a ``DPOPairDataset`` takes) or ``self.scored_data`` (the
    datums, made on that read) in ``train_dataloader`` / ``val_dataloader``. Call ``super().__init__()``,
    ``super().setup(stage)`` if you override ``setup`` (after loading what ``dpo_data`` returns),
    and ``super()`` in ``state_dict`` / ``load_state_dict`` if you override them.

    Its state is one ``ReferenceScoring``: ``setup("fit")`` checks the data (stage ``PENDING``),
    then ``score_reference()`` loads the reference logprobs from the cache or scores them (each
    rank its share of the pairs, see ``compute_reference_logprobs``; stage ``SCORED``). It runs:

    - for an explicit reference, in ``setup("fit")`` (a checkpoint is loaded into a copy of the
      LightningModule before the strategy moves, wraps or shards it);
    - for the default reference (``reference=None``), the LightningModule itself, in the
      ``on_fit_start`` hook (a callback the mixin adds to the trainer in ``setup("fit")``): after
      the strategy has set the module up (device, DDP, FSDP / FSDP2 sharding, ``configure_model``),
      before the sanity check, any dataloader and the first optimizer step, so the initial policy
      is scored in place with no copy of its weights. Its ``forward(input_ids)`` must return logits
      ``[B, T, V]`` (or an object with ``.logits``); a Hugging Face model inside it is scored from
      its output head (no full logits);
    - without a trainer (``setup("fit")`` called by hand), in ``setup("fit")``.

    ``scored_pairs`` and ``scored_data`` only read: before scoring they are a ``RuntimeError``. Every checkpoint records
    the initial policy's fingerprint (``state_dict``); a resumed run (``fit(ckpt_path=...)``),
    whose module holds trained weights, takes the values from the cache that matches it, and a
    missing or mismatching cache is a ``ReferenceCacheError`` that names the fix (the cache file,
    or an explicit ``reference=`` checkpoint of the initial policy). ``validate`` / ``test`` after
    ``fit`` keep the scored data.

    The cache lives in ``cache_dir`` (default ``<trainer.default_root_dir>/reference_logprobs``),
    one file per reference, data and scoring dtype, so runs may share it; see and prune the caches
    with ``loops-callbacks cache list|prune DIR``.

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
        self._reference = ReferenceScoring()

    def configure_reference(
        self,
        reference: Any = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        use_cache: bool = True,
        scoring_dtype: ScoringDtype | None = None,
        max_tokens_per_batch: int | None = None,
        reference_fingerprint: str | None = None,
        progress: bool = True,
        check_prompts: bool = True,
        scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT,
    ) -> None:
        """Set how the reference logprobs are scored and cached (all checked here, with messages naming the bad value).

        Args:
            reference: a ``SamplingClient``, an ``nn.Module``, a callable ``fn(input_ids) -> logits``,
                a checkpoint path (a Lightning ``.ckpt`` or a state dict of the LightningModule), or
                ``None`` for the LightningModule itself (the initial policy, no copy).
            cache_dir: where the cache file lives (default: ``<default_root_dir>/reference_logprobs``).
            use_cache: ``False`` scores on every run and writes nothing (a resumed run with the
                default reference then has no way to its initial policy: an error).
            scoring_dtype: score a local reference in this dtype (default: the model's own); the
                policy itself is not cast but run under autocast in this dtype (default: the
                training precision).
            max_tokens_per_batch: padded-token budget per forward pass of a local reference.
            reference_fingerprint: the identity of a client whose weights cannot be hashed here;
                without one, such a client is scored on every run.
            progress: a progress bar on rank 0 while scoring.
            check_prompts: reject pairs whose chosen and rejected prompts differ (by their weights).
            scoring_timeout: seconds a rank waits for the others at each step of reading and
                scoring the data before naming the ranks that stalled (``None``: no limit).
        """
        if reference is not None and isinstance(reference, str) and not reference:
            raise ValueError("reference='' is not a path; use None for the LightningModule itself")
        self._reference.config = ReferenceConfig(
            reference=reference,
            cache_dir=os.fspath(cache_dir) if isinstance(cache_dir, os.PathLike) else cache_dir,
            use_cache=use_cache,
            scoring_dtype=scoring_dtype,
            max_tokens_per_batch=max_tokens_per_batch,
            reference_fingerprint=reference_fingerprint,
            progress=progress,
            check_prompts=check_prompts,
            scoring_timeout=scoring_timeout,
        )

    @property
    def reference_config(self) -> ReferenceConfig:
        """The settings ``configure_reference`` made (the defaults when it was not called)."""
        return self._reference.config

    @property
    def reference_stage(self) -> Stage:
        """``NOT_SET_UP``, ``PENDING`` (checked, not scored yet) or ``SCORED``."""
        return self._reference.stage

    def dpo_data(self) -> Sequence[Any]:
        """The interleaved DPO datums to score (override this, or ``dpo_pairs``)."""
        raise NotImplementedError(f"{type(self).__name__} must define dpo_data() returning the interleaved datums")

    def dpo_pairs(self) -> PackedPairs:
        """The interleaved DPO pairs, packed (``preference_pairs``, ``check_dpo_pairs``): override this instead
        of ``dpo_data`` to make no datum at all. When a subclass defines it, ``setup("fit")`` reads it (and checks
        it, ``check_packed_pairs``) rather than ``dpo_data()``, unless the subclass defines both and the reference
        is a client that scores datums (it then gets ``dpo_data()``'s own datums).
        """
        raise NotImplementedError(f"{type(self).__name__} does not define dpo_pairs(); it gives dpo_data()")

    def source_datums(self) -> list[Any] | None:
        """The user's own datums behind ``dpo_pairs()``, if there are any (``None``, the default: the pairs
        were made without datums, e.g. tokenized records). ``scored_data`` attaches the values to these
        datums, so no field of theirs is dropped; override it along with ``dpo_pairs`` when the pairs
        come from datums the user gave."""
        return None

    @property
    def scored_data(self) -> list[Any]:
        """``dpo_data()`` with ``ref_logprobs`` attached (float32 arrays, one buffer for all datums).

        Available once scored (see the class docstring): read it in a dataloader hook. The
        datums are made on the first read (the values are kept as one buffer until then; a
        ``DPOPairDataset`` reads ``scored_pairs`` instead, with no datum made). Under a strategy
        that restores checkpoints after its setup (FSDP, ...) and without a checkpoint, the first
        read scores the policy (no hook comes between that restore and the dataloaders).
        """
        state = self._scored_state("scored_data")
        if state.scored is None:
            assert state.pairs is not None and state.pairs.ref_logprobs is not None
            if state.datums is not None:  # the user's own datums, every field of theirs kept
                state.scored = attach_reference_values(state.datums, state.pairs.ref_logprobs, state.pairs.offsets)
            else:
                state.scored = state.pairs.datums()
        return state.scored

    @property
    def scored_pairs(self) -> PackedPairs:
        """The scored pairs in the packed form batches are cut from: ``DPOPairDataset(self.scored_pairs)``.

        The pairs ``setup("fit")`` checked and packed (ids, targets and weights in flat arrays),
        with the reference values as the one buffer they were scored into (no datum is made; see
        ``scored_data``).
        """
        state = self._scored_state("scored_pairs")
        assert state.pairs is not None
        return state.pairs

    def _scored_state(self, name: str) -> ReferenceScoring:
        """The state once scored, or a ``RuntimeError`` saying when ``name`` can be read."""
        state = self._reference
        if state.stage is Stage.AFTER_RESTORE:  # no checkpoint came: the strategy's restore is over
            self.score_reference()
        if state.stage is Stage.SCORED:
            return state
        if state.stage is Stage.PENDING:
            raise RuntimeError(
                f"{type(self).__name__}.{name} was read before the strategy set the LightningModule up: with the "
                "default reference (the policy itself) it is scored in on_fit_start; read it in train_dataloader / "
                "val_dataloader, not in setup"
            )
        raise RuntimeError(
            f"{type(self).__name__}.{name} is computed in setup('fit'); run trainer.fit, or call setup('fit')"
        )

    @property
    def num_dpo_pairs(self) -> int:
        """How many pairs ``setup("fit")`` checked (known before the reference logprobs are)."""
        if self._reference.pairs is None:
            raise RuntimeError(f"{type(self).__name__}.num_dpo_pairs is known after setup('fit')")
        return len(self._reference.pairs) // 2

    @property
    def reference_report(self) -> ReferenceLogprobsReport | None:
        """What the last scoring did (loaded or scored, how many datums here, how long)."""
        return self._reference.report

    def setup(self, stage: str) -> None:
        super().setup(stage)  # type: ignore[misc]
        if stage != "fit":
            return
        state = self._reference
        state.stage, state.scored, state.report, state.saved = Stage.NOT_SET_UP, None, None, None
        state.pairs = state.datums = None
        state.pairs, state.datums = self._checked_data(state.config)
        state.stage = Stage.PENDING
        trainer = self._attached_trainer()
        if trainer is None or state.config.reference is not None:
            self.score_reference()
            return
        hook = _ScoreReferenceAfterStrategySetup
        if not any(isinstance(c, hook) and c.datamodule is self for c in trainer.callbacks):
            trainer.callbacks.append(hook(self))

    def score_reference(self) -> ReferenceLogprobsReport:
        """Load or score the reference logprobs of the pairs ``setup("fit")`` checked (on every rank at once).

        Called for you (see the class docstring); with the default reference, the strategy must
        have set the LightningModule up. A second call returns the first one's report.
        """
        state = self._reference
        if state.stage is Stage.NOT_SET_UP:
            raise RuntimeError(f"{type(self).__name__}.score_reference needs setup('fit') first")
        if state.stage in (Stage.PENDING, Stage.AFTER_RESTORE):
            assert state.pairs is not None
            trainer = self._attached_trainer()
            options = pair_scoring_options(state.config, self._cache_path(trainer, state.config))
            if state.config.reference is None and trainer is not None:
                values, report = self._score_policy(trainer, state.pairs.tokens, state.config, options)
            else:
                values, report = self._score_explicit(trainer, state.pairs, state.datums, state.config, options)
            state.stage, state.pairs, state.report = Stage.SCORED, state.pairs.scored(values), report
        assert state.report is not None
        return state.report

    def state_dict(self) -> dict[str, Any]:
        """Lightning saves this in checkpoints: with the default reference, the initial policy's fingerprint."""
        state = dict(super().state_dict())  # type: ignore[misc]
        if self._reference.saved:
            state["reference_logprobs"] = dict(self._reference.saved)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores this before ``on_fit_start`` (after it under FSDP / model parallel / DeepSpeed)."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        restored = state_dict.get("reference_logprobs")
        self._reference.restored = dict(restored) if isinstance(restored, dict) else None

    def _attached_trainer(self) -> Any:
        return getattr(self, "trainer", None)

    def _checked_data(self, config: ReferenceConfig) -> tuple[PackedPairs, list[Any] | None]:
        """``dpo_data()`` checked and packed in one pass, and the datums themselves when the reference
        scores datums (a remote client); an error on any rank is raised on every rank."""
        guard = StallGuard(Group(), config.scoring_timeout)
        with fail_together(guard, "checking the DPO pairs", then="the end of checking the DPO pairs"):
            datums_wanted = _defines(self, "dpo_data") and _scores_datums(config.reference)
            if _defines(self, "dpo_pairs") and not datums_wanted:
                return check_packed_pairs(self.dpo_pairs(), check_prompts=config.check_prompts), self.source_datums()
            data = list(self.dpo_data())
            pairs = check_dpo_pairs(data, check_prompts=config.check_prompts)  # before loading a reference
        return pairs, data  # the user's datums (references, no copy): scored_data attaches the values to them

    def _cache_path(self, trainer: Any, config: ReferenceConfig) -> str | None:
        if not config.use_cache:
            return None
        root = trainer.default_root_dir if trainer is not None else os.getcwd()
        return os.path.join(config.cache_dir or os.path.join(root, "reference_logprobs"), CACHE_FILE_NAME)

    def _score_explicit(
        self,
        trainer: Any,
        pairs: PackedPairs,
        datums: list[Any] | None,
        config: ReferenceConfig,
        options: ScoringOptions,
    ) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """A reference other than the policy: resolved (a copy, a client, a callable) from ``config`` and scored now."""
        client = resolve_reference(
            config.reference,
            config=config,
            lightning_module=trainer.lightning_module if trainer is not None else None,
            device=trainer.strategy.root_device if trainer is not None else None,
        )
        if datums is None and not callable(getattr(client, "score_packed", None)):
            datums = pairs.datums()  # a client that scores datums' model_input
        try:
            # which checks the token ids, once, naming the pair
            return score_packed_across_ranks(pairs.tokens, client, options, datums=datums)
        finally:
            del client
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _score_policy(
        self, trainer: Any, tokens: PackedTokens, config: ReferenceConfig, options: ScoringOptions
    ) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """The default reference: the policy as the strategy has set it up, or, on a resumed run, the cache."""
        tag = policy_tag(trainer, config.scoring_dtype)
        options = replace(options, cache_tag=tag)
        with torch.inference_mode(False):
            if trainer.ckpt_path is not None:
                result = self._load_initial_policy(trainer, tokens, options)
            else:
                policy = PolicyReference.from_trainer(trainer, config)
                # the policy's weights are fingerprinted: a reference_fingerprint names a client's
                result = score_packed_across_ranks(tokens, policy, replace(options, reference_fingerprint=None))
        self._reference.saved = {"reference_fingerprint": result[1].reference_fingerprint, "scoring_dtype": tag}
        return result

    def _load_initial_policy(
        self, trainer: Any, tokens: PackedTokens, options: ScoringOptions
    ) -> tuple[np.ndarray, ReferenceLogprobsReport]:
        """A resumed run: the module holds trained weights, so the initial policy's values come from the cache."""
        expected = (self._reference.restored or {}).get("reference_fingerprint")
        if expected is None:
            run_warnings.warn(
                f"the checkpoint {trainer.ckpt_path!r} does not record which initial policy the reference logprobs "
                "came from (saved by another DataModule or version): the cached values of these data are used "
                "whichever reference made them",
                ReferenceCacheWarning,
            )
        which = f" (weights fingerprint {expected[:16]}...)" if expected else ""
        where = "run with use_cache=True and the first run's cache_dir"
        if options.cache_path is not None:
            where = (
                f"restore the first run's cache file in {os.path.dirname(options.cache_path)} (or point cache_dir at "
                "the directory holding it)"
            )
        fix = (
            f"this run resumes from {trainer.ckpt_path}, so the LightningModule holds trained weights, not the "
            f"initial policy{which} whose logprobs are the DPO reference; they can only come from the cache the "
            f"first run wrote: {where}, or pass reference=<a checkpoint of the initial policy, saved before the "
            "first optimizer step> (a checkpoint is loaded into a copy of the module, so a model built in "
            "configure_model needs the cache file)"
        )
        # the initial policy's fingerprint, as the checkpoint recorded it
        initial = replace(options, reference_fingerprint=expected, cached_only=fix)
        return score_packed_across_ranks(tokens, None, initial)


def _defines(datamodule: ReferenceLogprobsMixin, hook: str) -> bool:
    """Whether the DataModule's class defines ``hook`` (``dpo_pairs``: the packed pairs; ``dpo_data``: datums)."""
    return getattr(type(datamodule), hook) is not getattr(ReferenceLogprobsMixin, hook)


def _scores_datums(reference: Any) -> bool:
    """Whether ``reference`` is a client that scores datums' ``model_input`` (no ``score_packed``), so the
    mixin keeps ``dpo_data()``'s own datums (their ``ModelInput`` class) until it is scored."""
    return hasattr(reference, "compute_logprobs") and not callable(getattr(reference, "score_packed", None))
