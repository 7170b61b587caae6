"""Reference logprobs for DPO data, computed once before training: cached, resumable, sharded over ranks.

``compute_reference_logprobs`` does the work for any process group; ``ReferenceLogprobsMixin`` runs
it from a ``LightningDataModule``'s ``setup("fit")``. In order:

1. the data are checked (``validate_dpo_pairs``): an even number of datums, no empty sequence,
   matching chosen/rejected prompts, field lengths, then token ids inside the reference's
   vocabulary; a ``ValueError`` names the pair before anything is scored;
2. the cache key is made: the reference's fingerprint (its weights, or the ``reference_fingerprint``
   you give for a client whose weights cannot be read here), the token data and the scoring dtype;
3. rank 0 reads the cache file; a whole file for this key is used and nothing is scored; a file
   for another key (changed reference or data) or a damaged one is warned about and replaced;
4. otherwise each rank scores only its shard, whole pairs (pair p on rank p % world_size), with
   ``attach_reference_logprobs`` (a progress bar on rank 0), and the results are gathered on every
   rank (``torch.distributed.all_gather_object``); rank 0 writes the cache (temporary file +
   ``os.replace``);
5. every rank gets the same new datums, as ``attach_reference_logprobs`` returns them.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from loops_callbacks.data.cache import CACHE_FILE_NAME, CacheKey, data_fingerprint, read_cache, write_cache
from loops_callbacks.data.dpo import check_vocabulary, validate_dpo_pairs
from loops_callbacks.data.reference import resolve_reference
from loops_callbacks.fields import datum_loss_fn_inputs, field_to_tensor
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.sampling import TorchSamplingClient

__all__ = [
    "ReferenceCacheWarning",
    "ReferenceConfig",
    "ReferenceLogprobsMixin",
    "ReferenceLogprobsReport",
    "compute_reference_logprobs",
]

log = logging.getLogger(__name__)

ScoringDtype = Literal["float32", "bfloat16", "float16"]
_SCORING_DTYPES = ("float32", "bfloat16", "float16")


class ReferenceCacheWarning(UserWarning):
    """The reference-logprob cache could not be used (stale or damaged) or written, or is off."""


@dataclass
class ReferenceLogprobsReport:
    """What ``compute_reference_logprobs`` did, as seen from this rank.

    ``source`` is ``"cache"`` (loaded, nothing scored) or ``"scored"``; ``scored_here`` counts the
    datums this rank scored; ``cache_status`` is the lookup's outcome (``"hit"``, ``"missing"``,
    ``"stale"``, ``"corrupt"``, or ``"off"`` when there is no cache).
    """

    source: Literal["cache", "scored"]
    num_datums: int
    scored_here: int
    seconds: float
    cache_path: str | None
    cache_status: str


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
    with the same ``data``; each rank scores about 1/world_size of the pairs and all get every
    result. Without a ``cache_path``, or without a fingerprint for ``reference`` (a client with no
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
    """
    start = time.perf_counter()
    data = list(data)
    tokens = validated_tokens if validated_tokens is not None else validate_dpo_pairs(data, check_prompts=check_prompts)
    group = _Group()
    fingerprint = _reference_fingerprint(reference, reference_fingerprint, group)
    check_vocabulary(tokens, getattr(reference, "vocab_size", None))
    lengths = [len(ids) for ids in tokens]

    path = os.fspath(cache_path) if cache_path is not None else None
    key = None
    if path is not None and fingerprint is None:
        group.warn_once(
            f"the reference ({type(reference).__name__}) has no fingerprint() and no reference_fingerprint was "
            "given, so its logprobs are not cached and will be scored again on every run"
        )
    elif path is not None:
        key = CacheKey(reference=fingerprint, data=data_fingerprint(tokens), dtype=scoring_dtype or "model")
    values, status = _load_on_rank_zero(path, key, lengths, group)

    scored_here = 0
    if values is None:
        mine = [i for pair in range(group.rank, len(data) // 2, group.world_size) for i in (2 * pair, 2 * pair + 1)]
        failure: BaseException | None = None
        try:
            shard = attach_reference_logprobs([data[i] for i in mine], reference, progress=progress and group.rank == 0)
            shard_values: list[np.ndarray] | str = [_ref_values(datum, i) for datum, i in zip(shard, mine)]
        except Exception as error:  # every rank must reach the gather, or the others wait forever
            failure, shard_values = error, f"{type(error).__name__}: {error}"
        gathered = group.all_gather((mine, shard_values))
        if failure is not None:
            raise failure
        failed = [f"rank {rank}: {parts}" for rank, (_, parts) in enumerate(gathered) if isinstance(parts, str)]
        if failed:
            raise RuntimeError(f"scoring the reference logprobs failed on another rank ({'; '.join(failed)})")
        scored_here = len(mine)
        values = [np.empty(0)] * len(data)
        for indices, parts in gathered:
            for i, part in zip(indices, parts):
                values[i] = part
        if group.rank == 0 and key is not None:
            try:
                write_cache(path, key, values)
            except OSError as error:
                group.warn_once(f"could not write the reference-logprob cache {path!r}: {error}")

    result = attach_reference_logprobs(data, _Replay(values))
    report = ReferenceLogprobsReport(
        source="cache" if status == "hit" else "scored",
        num_datums=len(data),
        scored_here=scored_here,
        seconds=time.perf_counter() - start,
        cache_path=path,
        cache_status=status,
    )
    if group.rank == 0:
        log.info(
            "reference logprobs of %d datums: %s in %.1f s (cache %s: %s)",
            len(data),
            "loaded" if status == "hit" else f"scored on {group.world_size} rank(s)",
            report.seconds,
            path,
            status,
        )
    return result, report


def _reference_fingerprint(reference: Any, given: str | None, group: _Group) -> str | None:
    """The reference's fingerprint, the same on every rank (rank 0's weights win for a torch client)."""
    method = getattr(reference, "fingerprint", None)
    fingerprint = given if given is not None else (str(method()) if callable(method) else None)
    if group.world_size == 1:
        return fingerprint
    fingerprints = group.all_gather(fingerprint)
    if len(set(fingerprints)) == 1:
        return fingerprint
    if isinstance(reference, TorchSamplingClient) and given is None:
        group.warn_once(
            "the reference weights differ across ranks (an unseeded initialization?); every rank scores with "
            "rank 0's weights, which DDP also gives the policy"
        )
        mine = {k: v.cpu() for k, v in reference.model.state_dict().items()} if group.rank == 0 else None
        state = group.broadcast(mine)
        reference.model.load_state_dict(state)
        return reference.fingerprint()
    raise ValueError(
        f"the reference differs across ranks (fingerprints {fingerprints}); every rank must score with the same one"
    )


def _load_on_rank_zero(
    path: str | None, key: CacheKey | None, lengths: list[int], group: _Group
) -> tuple[list[np.ndarray] | None, str]:
    """Rank 0 reads the cache and tells every rank what it found (so all ranks take the same branch)."""
    if path is None or key is None:
        return None, "off"
    found: tuple[list[np.ndarray] | None, str] = (None, "missing")
    if group.rank == 0:
        lookup = read_cache(path, key, lengths)
        if lookup.status in ("stale", "corrupt"):
            warnings.warn(
                f"the reference-logprob cache {path!r} is not used and will be replaced: {lookup.reason}; "
                "scoring again"
                + (
                    " (on a resumed run this means the module's initial weights are not those of the first run: "
                    "seed the run, or pass the initial weights as reference=<checkpoint>)"
                    if lookup.reason.startswith("the reference weights")
                    else ""
                ),
                ReferenceCacheWarning,
                stacklevel=3,
            )
        found = (lookup.values, lookup.status)
    return group.broadcast(found) if group.world_size > 1 else found


def _ref_values(datum: Any, index: int) -> np.ndarray:
    field = datum_loss_fn_inputs(datum, index=index)["ref_logprobs"]
    return field_to_tensor(field, where=f"datum {index}, key 'ref_logprobs'").double().cpu().numpy()


class _Replay:
    """A client that answers with values already scored, so that ``attach_reference_logprobs`` builds
    the datums the same way whether the values were scored here, on another rank, or read from the cache.
    """

    def __init__(self, values: list[np.ndarray]) -> None:
        self.values = values
        self.next = 0

    def compute_logprobs_batch(self, prompts: Sequence[Any]) -> list[list[float | None]]:
        answers = [[None, *v[:-1].tolist()] for v in self.values[self.next : self.next + len(prompts)]]
        self.next += len(prompts)
        return answers


class _Group:
    """This process's rank and the collectives, over ``torch.distributed`` when it is initialized."""

    def __init__(self) -> None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if distributed else 0
        self.world_size = torch.distributed.get_world_size() if distributed else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def warn_once(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, ReferenceCacheWarning, stacklevel=3)


@dataclass
class ReferenceConfig:
    """Settings of the reference-logprob hook; see ``ReferenceLogprobsMixin.configure_reference``."""

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
        """Set the hook's options (all checked here, with messages naming the bad value).

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
