"""``ReferenceLogprobsMixin``: a ``LightningDataModule`` whose DPO pairs get reference logprobs before training.

``compute_reference_logprobs`` is the same for any process group, outside Lightning: it checks the
pairs (``validate_dpo_pairs``: an even number of datums, no empty sequence, matching chosen/rejected
prompts, field lengths; then token ids inside the reference's vocabulary, each ``ValueError``
naming the pair before anything is scored) and hands the datums to
``loops_callbacks.reference.across_ranks.score_across_ranks`` (cache, shards, gather).

The default reference is the policy itself (``PolicyReference``), scored in place when the
trainer first asks for data: after the strategy has set the LightningModule up and before the
first optimizer step, so no copy of its weights ever exists. A resumed run (``fit(ckpt_path=...)``)
holds trained weights: it takes the initial policy's values from the cache, never from the module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from loops_callbacks import run_warnings
from loops_callbacks.data.dpo import check_vocabulary, validate_dpo_pairs
from loops_callbacks.data.labels import datum_label
from loops_callbacks.reference.across_ranks import (
    DEFAULT_SCORING_TIMEOUT,
    ReferenceCacheWarning,
    ReferenceLogprobsReport,
    score_across_ranks,
)
from loops_callbacks.reference.cache import CACHE_FILE_NAME
from loops_callbacks.reference.collectives import Group, StallGuard, raise_together
from loops_callbacks.reference.policy import PolicyReference, policy_tag
from loops_callbacks.reference.resolve import resolve_reference
from loops_callbacks.validation import check_dtype, check_int

__all__ = ["ReferenceConfig", "ReferenceLogprobsMixin", "ScoringDtype", "compute_reference_logprobs"]

ScoringDtype = Literal["float32", "bfloat16", "float16"]
SCORING_DTYPES: tuple[str, ...] = get_args(ScoringDtype)
"""The ``scoring_dtype`` choices (the names of ``ScoringDtype``)."""


def compute_reference_logprobs(
    data: Sequence[Any],
    reference: Any,
    *,
    cache_path: str | os.PathLike[str] | None = None,
    reference_fingerprint: str | None = None,
    scoring_dtype: str | None = None,
    progress: bool = True,
    check_prompts: bool = True,
    validated_tokens: list[list[int]] | None = None,
    cached_only: str | None = None,
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT,
) -> tuple[list[Any], ReferenceLogprobsReport]:
    """``attach_reference_logprobs(data, reference)``, scored once across ranks and cached on disk.

    Call it on every rank of an initialized ``torch.distributed`` group (or in a single process)
    with the same ``data``; the pairs are checked (``validate_dpo_pairs``, ``check_vocabulary``),
    then scored by ``score_across_ranks``: each rank scores one contiguous block of pairs with about
    1/world_size of the tokens, and all get every result. Without a ``cache_path``, or without a
    fingerprint for ``reference`` (a client with no ``fingerprint()`` method and no
    ``reference_fingerprint`` given), nothing is cached.

    Args:
        data: interleaved DPO datums (chosen at even indices, rejected at odd).
        reference: a ``SamplingClient``; a ``TorchSamplingClient`` whose weights differ across
            ranks is given rank 0's weights first (as DDP does to the policy).
        cache_path: the cache's base path: each key's file lies beside it (``cache_file``; found and
            written by rank 0, read into memory by every rank).
        reference_fingerprint: the reference's identity when ``reference`` has no ``fingerprint()``
            (e.g. the checkpoint path a remote sampler serves).
        scoring_dtype: part of the cache key (``None`` means the model's own dtype).
        progress: a progress bar on rank 0 while scoring.
        check_prompts: check that the chosen and rejected prompts of a pair match (see
            ``validate_dpo_pairs``).
        validated_tokens: what ``validate_dpo_pairs(data)`` returned, when the caller has checked
            ``data`` already (it is not checked again).
        cached_only: the values must come from the cache (nothing is scored; ``reference`` may be
            ``None``); the text ends the ``ReferenceCacheError`` of a miss (see ``score_across_ranks``).
        scoring_timeout: seconds a rank waits for the others at each step before naming the
            ranks that stalled (``RankStalledError``); ``None``: no limit.

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
        >>> scored, report = compute_reference_logprobs(data, Flat(), progress=False)
        >>> scored[1].loss_fn_inputs["ref_logprobs"].tolist(), report.cache_status
        ([-0.5, -0.5, 0.0], 'off')
    """
    data = list(data)
    tokens = validated_tokens if validated_tokens is not None else validate_dpo_pairs(data, check_prompts=check_prompts)
    check_vocabulary(tokens, getattr(reference, "vocab_size", None))
    return score_across_ranks(
        data,
        reference,
        tokens,
        cache_path=cache_path,
        reference_fingerprint=reference_fingerprint,
        scoring_dtype=scoring_dtype,
        progress=progress,
        shard_unit=2,  # a pair's two sequences on one rank
        cached_only=cached_only,
        scoring_timeout=scoring_timeout,
        datum_name=datum_label,
    )


@dataclass
class ReferenceConfig:
    """Settings of reference-logprob scoring for a DataModule; see ``ReferenceLogprobsMixin.configure_reference``."""

    reference: Any = None
    cache_dir: str | None = None
    use_cache: bool = True
    scoring_dtype: str | None = None
    max_tokens_per_batch: int | None = None
    reference_fingerprint: str | None = None
    progress: bool = True
    check_prompts: bool = True
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT

    def __post_init__(self) -> None:
        if self.scoring_dtype is not None:
            check_dtype("scoring_dtype", self.scoring_dtype, SCORING_DTYPES)
        if self.max_tokens_per_batch is not None:
            check_int("max_tokens_per_batch", self.max_tokens_per_batch, least=1)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir={self.cache_dir!r} must be a path or None")
        if self.reference_fingerprint is not None and not isinstance(self.reference_fingerprint, str):
            raise ValueError(f"reference_fingerprint={self.reference_fingerprint!r} must be a string or None")
        timeout = self.scoring_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"scoring_timeout={timeout!r} must be a number of seconds, or None for no limit")
        if timeout is not None and not timeout > 0:  # NaN too
            raise ValueError(f"scoring_timeout={timeout!r} must be more than 0 seconds, or None for no limit")
        for name in ("use_cache", "progress", "check_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")


class ReferenceLogprobsMixin:
    """Attach reference logprobs to a ``LightningDataModule``'s DPO data once, before training.

    Put it before ``LightningDataModule`` in the bases, call ``configure_reference`` in
    ``__init__`` (declare its arguments in your ``__init__`` to set them from YAML), return the
    interleaved datums (chosen at even indices, rejected at odd) from ``dpo_data``, and read
    ``self.scored_data`` in ``train_dataloader`` / ``val_dataloader``. In ``setup("fit")`` the
    mixin checks the data; the reference logprobs are loaded from the cache or scored (each rank
    its share of the pairs, see ``compute_reference_logprobs``) in ``setup("fit")`` for an explicit
    reference, and on the first read of ``scored_data`` for the default one. Call
    ``super().setup(stage)`` if you override ``setup`` (after loading what ``dpo_data`` returns),
    and ``super()`` in ``state_dict`` / ``load_state_dict`` if you override them.

    The default reference (``reference=None``) is the LightningModule itself, used in place once
    the strategy has set it up (device, DDP, FSDP / FSDP2 sharding, ``configure_model``) and before
    the first optimizer step: when the trainer first asks for data (``train_dataloader``, or
    ``val_dataloader`` for the sanity check), the initial policy, with no copy of its weights. Its
    ``forward(input_ids)`` must return logits ``[B, T, V]`` (or an object with ``.logits``); a
    Hugging Face model inside it is scored from its output head (no full logits). Read
    ``scored_data`` in a dataloader hook, not in ``setup``: before the strategy's setup it is an
    error. Every checkpoint records the initial policy's fingerprint (``state_dict``); a resumed
    run (``fit(ckpt_path=...)``), whose module holds trained weights, takes the values from the
    cache that matches it, and a missing or mismatching cache is a ``ReferenceCacheError`` that
    names the fix (the cache file, or an explicit ``reference=`` checkpoint of the initial policy).

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
                return DataLoader(DPOPairDataset(self.scored_data), batch_size=8, collate_fn=collate_dpo_pairs)
    """

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
        self._reference_config = ReferenceConfig(
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

    def dpo_data(self) -> Sequence[Any]:
        """The interleaved DPO datums to score (override this)."""
        raise NotImplementedError(f"{type(self).__name__} must define dpo_data() returning the interleaved datums")

    @property
    def scored_data(self) -> list[Any]:
        """``dpo_data()`` with ``ref_logprobs`` attached (float32 arrays, one buffer for all datums).

        Available after ``setup("fit")``; with the default reference, the first read (from a
        dataloader hook) scores the policy or loads its cached values.
        """
        if getattr(self, "_scored_data", None) is None and getattr(self, "_pending_policy", None) is not None:
            self._scored_data, self._reference_report = self.compute_scored_data()
            self._pending_policy = None
        scored = getattr(self, "_scored_data", None)
        if scored is None:
            raise RuntimeError(
                f"{type(self).__name__}.scored_data is computed in setup('fit'); run trainer.fit, or call setup('fit')"
            )
        return scored

    @property
    def num_dpo_pairs(self) -> int:
        """How many pairs ``setup("fit")`` checked (known before the reference logprobs are)."""
        count = getattr(self, "_num_dpo_pairs", None)
        if count is None:
            raise RuntimeError(f"{type(self).__name__}.num_dpo_pairs is known after setup('fit')")
        return count

    @property
    def reference_report(self) -> ReferenceLogprobsReport | None:
        """What the last scoring did (loaded or scored, how many datums here, how long)."""
        return getattr(self, "_reference_report", None)

    def setup(self, stage: str) -> None:
        super().setup(stage)  # type: ignore[misc]
        if stage != "fit":
            return
        config = self._config()
        trainer = getattr(self, "trainer", None)
        self._scored_data, self._reference_report = None, None
        self._pending_policy = None
        if config.reference is None and trainer is not None:
            self._pending_policy = self._checked_data(config)  # scored on the first read of scored_data
            self._optimizers_at_setup = trainer.strategy.optimizers  # the strategy's setup replaces this list
            return
        self._scored_data, self._reference_report = self.compute_scored_data()

    def compute_scored_data(self) -> tuple[list[Any], ReferenceLogprobsReport]:
        """Check ``dpo_data()``, then load or score the reference logprobs (for the default reference:
        of the policy itself, which the strategy must have set up)."""
        config = self._config()
        if config.reference is None and getattr(self, "trainer", None) is not None:
            pending = getattr(self, "_pending_policy", None)
            return self._score_policy(*(pending if pending is not None else self._checked_data(config)))
        data, tokens = self._checked_data(config)
        return self._score_explicit(data, tokens, config)

    def state_dict(self) -> dict[str, Any]:
        """Lightning saves this in checkpoints: with the default reference, the initial policy's fingerprint."""
        state = dict(super().state_dict())  # type: ignore[misc]
        reference_state = getattr(self, "_reference_state", None)
        if reference_state:
            state["reference_logprobs"] = dict(reference_state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores this before the first dataloader is asked for (``fit(ckpt_path=...)``)."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        restored = state_dict.get("reference_logprobs")
        self._restored_reference_state = dict(restored) if isinstance(restored, dict) else None

    def _config(self) -> ReferenceConfig:
        return getattr(self, "_reference_config", None) or ReferenceConfig()

    def _checked_data(self, config: ReferenceConfig) -> tuple[list[Any], list[list[int]]]:
        """``dpo_data()`` and its checked token ids; an error on any rank is raised on every rank."""
        failure: BaseException | None = None
        data: list[Any] = []
        tokens: list[list[int]] = []
        try:
            data = list(self.dpo_data())
            tokens = validate_dpo_pairs(data, check_prompts=config.check_prompts)  # before loading a reference
        except Exception as error:  # noqa: BLE001 - a rank whose data fail must not leave the others waiting
            failure = error
        group = Group()
        StallGuard(group, config.scoring_timeout).arrive("the end of checking the DPO pairs")
        raise_together(group, failure, "checking the DPO pairs")
        self._num_dpo_pairs = len(data) // 2
        return data, tokens

    def _cache_path(self, config: ReferenceConfig) -> str | None:
        if not config.use_cache:
            return None
        trainer = getattr(self, "trainer", None)
        root = trainer.default_root_dir if trainer is not None else os.getcwd()
        return os.path.join(config.cache_dir or os.path.join(root, "reference_logprobs"), CACHE_FILE_NAME)

    def _score_explicit(
        self, data: list[Any], tokens: list[list[int]], config: ReferenceConfig
    ) -> tuple[list[Any], ReferenceLogprobsReport]:
        """A reference other than the policy: resolved (a copy, a client, a callable) and scored now."""
        trainer = getattr(self, "trainer", None)
        client = resolve_reference(
            config.reference,
            lightning_module=trainer.lightning_module if trainer is not None else None,
            dtype=config.scoring_dtype,
            device=trainer.strategy.root_device if trainer is not None else None,
            max_tokens_per_batch=config.max_tokens_per_batch,
        )
        try:
            return compute_reference_logprobs(
                data,
                client,
                cache_path=self._cache_path(config),
                reference_fingerprint=config.reference_fingerprint,
                scoring_dtype=config.scoring_dtype,
                progress=config.progress,
                check_prompts=config.check_prompts,
                validated_tokens=tokens,
                scoring_timeout=config.scoring_timeout,
            )
        finally:
            del client
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _score_policy(self, data: list[Any], tokens: list[list[int]]) -> tuple[list[Any], ReferenceLogprobsReport]:
        """The default reference: the policy as the strategy has set it up, or, on a resumed run, the cache."""
        config = self._config()
        trainer = self.trainer  # type: ignore[attr-defined]
        if trainer.strategy.optimizers is getattr(self, "_optimizers_at_setup", None):
            raise RuntimeError(
                f"{type(self).__name__}.scored_data was read before the strategy set the LightningModule up: with "
                "the default reference (the policy itself) read it in train_dataloader / val_dataloader, not in setup"
            )
        cache_path = self._cache_path(config)
        tag = policy_tag(trainer, config.scoring_dtype)
        with torch.inference_mode(False):
            if trainer.ckpt_path is not None:
                result = self._load_initial_policy(data, tokens, config, cache_path, tag)
            else:
                policy = PolicyReference.from_trainer(
                    trainer, scoring_dtype=config.scoring_dtype, max_tokens_per_batch=config.max_tokens_per_batch
                )
                result = compute_reference_logprobs(
                    data,
                    policy,
                    cache_path=cache_path,
                    scoring_dtype=tag,
                    progress=config.progress,
                    validated_tokens=tokens,
                    scoring_timeout=config.scoring_timeout,
                )
        self._reference_state = {"reference_fingerprint": result[1].reference_fingerprint, "scoring_dtype": tag}
        return result

    def _load_initial_policy(
        self, data: list[Any], tokens: list[list[int]], config: ReferenceConfig, cache_path: str | None, tag: str
    ) -> tuple[list[Any], ReferenceLogprobsReport]:
        """A resumed run: the module holds trained weights, so the initial policy's values come from the cache."""
        trainer = self.trainer  # type: ignore[attr-defined]
        restored = getattr(self, "_restored_reference_state", None) or {}
        expected = restored.get("reference_fingerprint")
        if expected is None:
            run_warnings.warn(
                f"the checkpoint {trainer.ckpt_path!r} does not record which initial policy the reference logprobs "
                "came from (saved by another DataModule or version): the cached values of these data are used "
                "whichever reference made them",
                ReferenceCacheWarning,
            )
        which = f" (weights fingerprint {expected[:16]}...)" if expected else ""
        where = "run with use_cache=True and the first run's cache_dir"
        if cache_path is not None:
            where = (
                f"restore the first run's cache file in {os.path.dirname(cache_path)} (or point cache_dir at the "
                "directory holding it)"
            )
        fix = (
            f"this run resumes from {trainer.ckpt_path}, so the LightningModule holds trained weights, not the "
            f"initial policy{which} whose logprobs are the DPO reference; they can only come from the cache the "
            f"first run wrote: {where}, or pass reference=<a checkpoint of the initial policy, saved before the "
            "first optimizer step> (a checkpoint is loaded into a copy of the module, so a model built in "
            "configure_model needs the cache file)"
        )
        return compute_reference_logprobs(
            data,
            None,
            cache_path=cache_path,
            reference_fingerprint=expected,
            scoring_dtype=tag,
            progress=config.progress,
            validated_tokens=tokens,
            cached_only=fix,
            scoring_timeout=config.scoring_timeout,
        )
