"""``ReferenceLogprobsMixin``: a ``LightningDataModule`` whose DPO pairs get reference logprobs before training.

``compute_reference_logprobs`` is the same for any process group, outside Lightning: it checks the
pairs (``validate_dpo_pairs``: an even number of datums, no empty sequence, matching chosen/rejected
prompts, field lengths; then token ids inside the reference's vocabulary, each ``ValueError``
naming the pair before anything is scored) and hands the datums to
``loops_callbacks.reference.across_ranks.score_across_ranks`` (cache, shards, gather).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from loops_callbacks.data.dpo import check_vocabulary, validate_dpo_pairs
from loops_callbacks.reference.across_ranks import ReferenceLogprobsReport, score_across_ranks
from loops_callbacks.reference.cache import CACHE_FILE_NAME
from loops_callbacks.reference.resolve import resolve_reference

__all__ = ["ReferenceConfig", "ReferenceLogprobsMixin", "ScoringDtype", "compute_reference_logprobs"]

ScoringDtype = Literal["float32", "bfloat16", "float16"]
_SCORING_DTYPES = ("float32", "bfloat16", "float16")


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
) -> tuple[list[Any], ReferenceLogprobsReport]:
    """``attach_reference_logprobs(data, reference)``, scored once across ranks and cached on disk.

    Call it on every rank of an initialized ``torch.distributed`` group (or in a single process)
    with the same ``data``; the pairs are checked (``validate_dpo_pairs``, ``check_vocabulary``),
    then scored by ``score_across_ranks``: each rank scores about 1/world_size of the pairs (pair p on
    rank p % world_size) and all get every result. Without a ``cache_path``, or without a fingerprint for ``reference`` (a client with no
    ``fingerprint()`` method and no ``reference_fingerprint`` given), nothing is cached.

    Args:
        data: interleaved DPO datums (chosen at even indices, rejected at odd).
        reference: a ``SamplingClient``; a ``TorchSamplingClient`` whose weights differ across
            ranks is given rank 0's weights first (as DDP does to the policy).
        cache_path: the cache file (read by rank 0, written by rank 0).
        reference_fingerprint: the reference's identity when ``reference`` has no ``fingerprint()``
            (e.g. the checkpoint path a remote sampler serves).
        scoring_dtype: part of the cache key (``None`` means the model's own dtype).
        progress: a progress bar on rank 0 while scoring.
        check_prompts: check that the chosen and rejected prompts of a pair match (see
            ``validate_dpo_pairs``).
        validated_tokens: what ``validate_dpo_pairs(data)`` returned, when the caller has checked
            ``data`` already (it is not checked again).

    Returns:
        The new datums (in ``data``'s order) and a ``ReferenceLogprobsReport``.

    Example:
        >>> from loops_callbacks.data.dpo import dpo_pair_datums
        >>> class Flat:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-0.5] * (prompt.length - 1)
        >>> data = list(dpo_pair_datums([1, 5, 6], [1, 5, 7], prompt_length=2))
        >>> scored, report = compute_reference_logprobs(data, Flat(), progress=False)
        >>> scored[1].loss_fn_inputs["ref_logprobs"].data, report.cache_status
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

    def __post_init__(self) -> None:
        if self.scoring_dtype is not None and self.scoring_dtype not in _SCORING_DTYPES:
            raise ValueError(f"scoring_dtype={self.scoring_dtype!r} is not one of {list(_SCORING_DTYPES)} or None")
        budget = self.max_tokens_per_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"max_tokens_per_batch={budget!r} must be a positive int or None")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise ValueError(f"cache_dir={self.cache_dir!r} must be a path or None")
        if self.reference_fingerprint is not None and not isinstance(self.reference_fingerprint, str):
            raise ValueError(f"reference_fingerprint={self.reference_fingerprint!r} must be a string or None")
        for name in ("use_cache", "progress", "check_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")


class ReferenceLogprobsMixin:
    """Attach reference logprobs to a ``LightningDataModule``'s DPO data once, before training.

    Put it before ``LightningDataModule`` in the bases, call ``configure_reference`` in
    ``__init__`` (declare its arguments in your ``__init__`` to set them from YAML), return the
    interleaved datums (chosen at even indices, rejected at odd) from ``dpo_data``, and read
    ``self.scored_data`` in ``train_dataloader``. In ``setup("fit")`` the mixin checks the data,
    then loads the reference logprobs from the cache or scores them (each rank its share of the
    pairs), see ``compute_reference_logprobs``. Call ``super().setup(stage)`` if you override
    ``setup`` (after loading what ``dpo_data`` returns).

    The default reference is a frozen copy of the LightningModule at ``setup("fit")``: the initial
    policy, since no optimizer has stepped and a resumed checkpoint is restored after ``setup``.
    Its ``forward(input_ids)`` must return logits ``[B, T, V]`` (or an object with ``.logits``).
    A module that builds its layers in ``configure_model`` (which runs after ``setup``) has none
    yet (nor a checkpoint to load into): give it a ``reference`` module or client. The copy lives
    on the strategy's root device only while scoring. The cache lives in ``cache_dir`` (default
    ``<trainer.default_root_dir>/reference_logprobs``), one file per directory: give each data set
    its own ``cache_dir``.

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
    ) -> None:
        """Set how the reference logprobs are scored and cached (all checked here, with messages naming the bad value).

        Args:
            reference: a ``SamplingClient``, an ``nn.Module``, a checkpoint path (a Lightning
                ``.ckpt`` or a state dict of the LightningModule), or ``None`` for a snapshot of the
                LightningModule at ``setup("fit")``.
            cache_dir: where the cache file lives (default: ``<default_root_dir>/reference_logprobs``).
            use_cache: ``False`` scores on every run and writes nothing.
            scoring_dtype: score a local reference in this dtype (default: the model's own).
            max_tokens_per_batch: padded-token budget per forward pass of a local reference.
            reference_fingerprint: the identity of a client whose weights cannot be hashed here;
                without one, such a client is scored on every run.
            progress: a progress bar on rank 0 while scoring.
            check_prompts: reject pairs whose chosen and rejected prompts differ (by their weights).
        """
        if reference is not None and isinstance(reference, str) and not reference:
            raise ValueError("reference='' is not a path; use None for a snapshot of the LightningModule")
        self._reference_config = ReferenceConfig(
            reference=reference,
            cache_dir=os.fspath(cache_dir) if isinstance(cache_dir, os.PathLike) else cache_dir,
            use_cache=use_cache,
            scoring_dtype=scoring_dtype,
            max_tokens_per_batch=max_tokens_per_batch,
            reference_fingerprint=reference_fingerprint,
            progress=progress,
            check_prompts=check_prompts,
        )

    def dpo_data(self) -> Sequence[Any]:
        """The interleaved DPO datums to score (override this)."""
        raise NotImplementedError(f"{type(self).__name__} must define dpo_data() returning the interleaved datums")

    @property
    def scored_data(self) -> list[Any]:
        """``dpo_data()`` with ``ref_logprobs`` attached (available after ``setup("fit")``)."""
        scored = getattr(self, "_scored_data", None)
        if scored is None:
            raise RuntimeError(
                f"{type(self).__name__}.scored_data is computed in setup('fit'); run trainer.fit, or call setup('fit')"
            )
        return scored

    @property
    def reference_report(self) -> ReferenceLogprobsReport | None:
        """What the last ``setup("fit")`` did (loaded or scored, how many datums here, how long)."""
        return getattr(self, "_reference_report", None)

    def setup(self, stage: str) -> None:
        super().setup(stage)  # type: ignore[misc]
        if stage == "fit":
            self._scored_data, self._reference_report = self.compute_scored_data()

    def compute_scored_data(self) -> tuple[list[Any], ReferenceLogprobsReport]:
        """Check ``dpo_data()``, resolve the reference, and load or score the reference logprobs."""
        config = getattr(self, "_reference_config", None) or ReferenceConfig()
        trainer = getattr(self, "trainer", None)
        data = list(self.dpo_data())
        tokens = validate_dpo_pairs(data, check_prompts=config.check_prompts)  # before loading a reference
        client = resolve_reference(
            config.reference,
            lightning_module=trainer.lightning_module if trainer is not None else None,
            dtype=config.scoring_dtype,
            device=trainer.strategy.root_device if trainer is not None else None,
            max_tokens_per_batch=config.max_tokens_per_batch,
        )
        cache_path = None
        if config.use_cache:
            root = trainer.default_root_dir if trainer is not None else os.getcwd()
            cache_path = os.path.join(config.cache_dir or os.path.join(root, "reference_logprobs"), CACHE_FILE_NAME)
        try:
            return compute_reference_logprobs(
                data,
                client,
                cache_path=cache_path,
                reference_fingerprint=config.reference_fingerprint,
                scoring_dtype=config.scoring_dtype,
                progress=config.progress,
                check_prompts=config.check_prompts,
                validated_tokens=tokens,
            )
        finally:
            del client
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
