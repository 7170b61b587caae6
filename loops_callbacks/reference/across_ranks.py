"""Reference logprobs scored once across ranks and cached on disk: ``score_across_ranks``.

It knows datums and token ids, not what the data mean (DPO pairs are checked by the caller,
``loops_callbacks.data``). In order:

1. the token ids are packed once into flat arrays (``PackedTokens``), and the ranks compare them
   (a count and one digest each, ``check_ranks_agree``): ranks that hold different datums raise
   ``RanksDisagreeError`` on every rank, naming the first that differs, before anything is scored
   or cached; then every id is checked, once (``check_token_ids``: an ``OutOfVocabularyError``
   naming the datum and position of the first outside the reference's vocabulary; the scorers take
   the checked form and do not read the ids again). The cache key is made: the reference's
   fingerprint (its weights, or the ``reference_fingerprint`` you give for a client whose weights
   cannot be read here), the token data and the scoring dtype;
2. rank 0 finds this key's cache file (``find_cache``: one file per key beside ``cache_path``) and
   checks it whole; then nothing is scored: every rank reads it into its own memory and checks
   that what it read has rank 0's checksum (so a file changed under the job changes nothing), or,
   where a rank cannot, receives rank 0's values as a tensor. A damaged file is warned about and
   replaced; caches of other keys (reference, data, dtype) are named in a warning and kept;
3. otherwise each rank scores one contiguous block of ``shard_unit``-datum units, with about the
   same number of tokens as every other rank's: with ``score_packed`` when the reference has it
   (``TorchSamplingClient``, ``PolicyReference``: no Python list on the way; the policy scores in
   lock-step), else with ``attach_reference_logprobs`` (remote clients). The blocks are gathered
   as one float32 tensor on every rank (one broadcast per rank, in place), and rank 0 writes the
   cache (temporary file + ``os.replace``);
4. every rank gets that one float32 array, in the tokens' packed layout (``score_packed_across_ranks``
   stops here: token ids in, values out, no datum); ``score_across_ranks``, the datum boundary,
   returns new datums whose ``ref_logprobs`` are float32 views of it (``attach_reference_values``):
   4 bytes a token, and no Python float per token.

With ``cached_only`` nothing is scored: the values must come from the cache (a resumed run whose
reference was the initial policy), and a missing or mismatching file is a ``ReferenceCacheError``.

Before each collective step the ranks meet (``StallGuard``): a rank that does not come within
``scoring_timeout`` seconds is named, with the step, by a ``RankStalledError`` on every rank.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.progress import ProgressBar
from loops_callbacks.fields import datum_loss_fn_inputs, field_to_tensor
from loops_callbacks.reference.attach import attach_reference_logprobs, attach_reference_values
from loops_callbacks.reference.cache import CACHE_TOOL, CacheKey, data_fingerprint, find_cache, read_cache, write_cache
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.reference.collectives import Group as _Group
from loops_callbacks.reference.collectives import StallGuard, fail_together
from loops_callbacks.reference.config import DEFAULT_SCORING_TIMEOUT, ScoringOptions
from loops_callbacks.reference.packing import PackedTokens, check_token_ids
from loops_callbacks.reference.rank_agreement import check_ranks_agree, token_digests

__all__ = [
    "DEFAULT_SCORING_TIMEOUT",
    "ReferenceCacheError",
    "ReferenceCacheWarning",
    "ReferenceLogprobsReport",
    "ScoringOptions",
    "score_across_ranks",
    "score_packed_across_ranks",
]

log = logging.getLogger(__name__)


class ReferenceCacheWarning(UserWarning):
    """The reference-logprob cache could not be used (stale or damaged) or written, or is off."""


class ReferenceCacheError(RuntimeError):
    """The values had to come from the cache (``cached_only``) and it is missing or does not match."""


@dataclass
class ReferenceLogprobsReport:
    """What ``score_across_ranks`` did, as seen from this rank.

    ``source`` is ``"cache"`` (loaded, nothing scored) or ``"scored"``; ``scored_here`` counts the
    datums this rank scored; ``cache_status`` is the lookup's outcome (``"hit"``, ``"missing"``,
    ``"stale"``, ``"corrupt"``, or ``"off"`` when there is no cache); ``cache_key`` is the key the
    values are (or would be) cached under; ``cache_written`` says that this rank wrote the scored
    values to ``cache_path`` (rank 0 writes; a failed write is a warning).
    """

    source: Literal["cache", "scored"]
    num_datums: int
    scored_here: int
    seconds: float
    cache_path: str | None
    cache_status: str
    cache_key: CacheKey | None = None
    reference_fingerprint: str | None = None
    cache_written: bool = False


def score_across_ranks(
    data: Sequence[Any],
    reference: Any,
    tokens: Sequence[Sequence[int]] | PackedTokens,
    *,
    cache_path: str | os.PathLike[str] | None = None,
    reference_fingerprint: str | None = None,
    cache_tag: str = "model",
    progress: bool = True,
    shard_unit: int = 1,
    cached_only: str | None = None,
    scoring_timeout: float | None = DEFAULT_SCORING_TIMEOUT,
    datum_name: Callable[[int], str] | None = None,
) -> tuple[list[Any], ReferenceLogprobsReport]:
    """``attach_reference_logprobs(data, reference)``, scored once across ranks and cached on disk.

    Call it on every rank of an initialized ``torch.distributed`` group (or in a single process)
    with the same ``data``, already checked by the caller, and ``tokens`` (each datum's token ids,
    or them packed). The datums are dealt to the ranks in contiguous blocks of ``shard_unit``
    consecutive datums, balanced by tokens, and all ranks get every result. Without a
    ``cache_path``, or without a fingerprint for ``reference`` (a client with no
    ``fingerprint()`` method and no ``reference_fingerprint`` given), nothing is cached.

    The keywords after ``tokens`` are the fields of one ``ScoringOptions`` (same names and
    defaults), made here once and handed whole to ``score_packed_across_ranks``.

    Args:
        data: the datums to score.
        reference: a ``SamplingClient``; a ``TorchSamplingClient`` whose weights differ across
            ranks is given rank 0's weights first (as DDP does to the policy). Unused with ``cached_only``.
        tokens: ``data``'s token ids, one list per datum (or ``PackedTokens``).
        cache_path: the cache's base path: this key's values are in ``cache_file(cache_path, key)``
            beside it (found and written by rank 0, read by every rank); a file at ``cache_path``
            itself (the single-file layout of earlier versions) is read when its key matches.
        reference_fingerprint: the reference's identity when ``reference`` has no ``fingerprint()``
            (e.g. the checkpoint path a remote sampler serves); with ``cached_only``, the identity
            the cached values must have (``None``: any reference, for these data and dtype).
        cache_tag: the cache key's tag: what the values depend on besides the reference's
            weights and the data (``ReferenceConfig.cache_tag``: the scoring dtype, ``"model"`` for
            the model's own, or ``policy_tag`` for the policy under the training precision).
        progress: a progress bar (tokens) on rank 0 while scoring.
        shard_unit: datums that stay together on one rank (2 keeps a DPO pair's two sequences
            together); ``len(data)`` must be a multiple of it.
        cached_only: never score; the cache must hold the values. The text says why (and how to
            fix a miss): it ends the ``ReferenceCacheError`` message.
        scoring_timeout: seconds a rank waits for the others before each collective step; a rank
            that does not come is named (``RankStalledError``) on every rank (``None``: no limit).
        datum_name: how an error names datum ``i`` (default ``datum i``), e.g. ``datum_label``.

    Before anything else the ranks compare their token ids (a count and one digest each): ranks
    that hold different data raise ``RanksDisagreeError`` naming the first datum that differs. Then
    each id is checked once against the reference's ``vocab_size`` (negative ids only, without one):
    an ``OutOfVocabularyError`` names the datum (``datum_name``) and the position.

    Returns:
        The new datums (in ``data``'s order), each ``ref_logprobs`` a float32 view of one array
        for our datums (the datum's own ``TensorData`` for Tinker / Loops datums), and a
        ``ReferenceLogprobsReport``.

    Example:
        >>> from loops_callbacks.types import Datum, ModelInput
        >>> class Flat:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-0.5] * (prompt.length - 1)
        >>> data = [Datum(ModelInput.from_ints([1, 2, 3]))]
        >>> scored, report = score_across_ranks(data, Flat(), [[1, 2, 3]], progress=False)
        >>> scored[0].loss_fn_inputs["ref_logprobs"].tolist(), report.source
        ([-0.5, -0.5, 0.0], 'scored')
    """
    data = list(data)
    packed = tokens if isinstance(tokens, PackedTokens) else PackedTokens.from_sequences(tokens)
    if len(packed) != len(data):
        raise ValueError(f"score_across_ranks: {len(packed)} token sequences for {len(data)} datums")
    options = ScoringOptions(
        cache_path=cache_path,
        reference_fingerprint=reference_fingerprint,
        cache_tag=cache_tag,
        progress=progress,
        shard_unit=shard_unit,
        cached_only=cached_only,
        scoring_timeout=scoring_timeout,
        datum_name=datum_name,
    )
    values, report = score_packed_across_ranks(packed, reference, options, datums=data)
    return attach_reference_values(data, values, packed.offsets), report


def score_packed_across_ranks(
    packed: PackedTokens,
    reference: Any,
    options: ScoringOptions | None = None,
    *,
    datums: Sequence[Any] | None = None,
) -> tuple[np.ndarray, ReferenceLogprobsReport]:
    """``score_across_ranks`` on the packed form: token ids in, one float32 buffer of values out, no datum.

    Sequence i's values (the ``ref_logprobs`` layout: value k is log p(token k + 1), the last 0)
    are ``values[packed.offsets[i]:packed.offsets[i + 1]]``. ``options`` (one ``ScoringOptions``,
    default ``ScoringOptions()``) are ``score_across_ranks``'s keywords in one object; ``datums``
    (``packed``'s sequences as datums) are read only by a reference without ``score_packed`` (a
    remote client scores each datum's ``model_input``, through ``attach_reference_logprobs``).

    Example:
        >>> import torch
        >>> from loops_callbacks.reference.clients import TorchSamplingClient
        >>> client = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(8, 8)))
        >>> packed = PackedTokens.from_sequences([[1, 2], [3]])
        >>> values, report = score_packed_across_ranks(packed, client, ScoringOptions(progress=False))
        >>> values.dtype, values.shape, values[1:].tolist(), report.num_datums
        (dtype('float32'), (3,), [0.0, 0.0], 2)
    """
    start = time.perf_counter()
    options = options if options is not None else ScoringOptions()
    count = len(packed)
    shard_unit, cached_only, path = options.shard_unit, options.cached_only, options.cache_path
    if count % shard_unit:
        raise ValueError(f"score_across_ranks: {count} datums are not a whole number of units of {shard_unit}")
    if datums is not None and len(datums) != count:
        raise ValueError(f"score_across_ranks: {count} token sequences for {len(datums)} datums")
    group = _Group()
    guard = StallGuard(group, options.scoring_timeout)
    # the token data's digest, computed once: compared across ranks, and part of the cache key
    digest = functools.cache(functools.partial(data_fingerprint, packed))
    name = options.datum_name or (lambda index: f"datum {index}")
    _check_same_tokens(packed, digest, group, guard, name)
    # the one check of the ids, on every rank (a bad id fails all ranks alike), before any forward;
    # the scorers take the checked form and do not read the ids again
    packed = check_token_ids(packed, getattr(reference, "vocab_size", None), datum_name=name)
    if cached_only is not None:
        if path is None:
            raise ReferenceCacheError(f"there is no reference-logprob cache to read (the cache is off): {cached_only}")
        fingerprint = options.reference_fingerprint
    else:
        guard.arrive("the reference's fingerprint")
        fingerprint = _reference_fingerprint(reference, options.reference_fingerprint, group)

    key = None
    if path is not None and fingerprint is None and cached_only is None:
        group.warn_once(
            f"the reference ({type(reference).__name__}) has no fingerprint() and no reference_fingerprint was "
            "given, so its logprobs are not cached and will be scored again on every run",
            ReferenceCacheWarning,
        )
    elif path is not None:
        key = CacheKey(reference=fingerprint, data=digest(), dtype=options.cache_tag)
    values, status, reason, stored_reference, file = _load(path, key, packed.lengths, group, warn=cached_only is None)
    if values is None and cached_only is not None:
        raise ReferenceCacheError(f"{_describe(status, reason, file or path)}: {cached_only}")

    scored_here = 0
    cache_written = False
    if values is None:
        bounds = _shard_bounds(packed.lengths, shard_unit, group.world_size)
        first, last = bounds[group.rank], bounds[group.rank + 1]
        guard.note(f"scoring its block (datums {first} to {last - 1} of {count})")
        with fail_together(guard, "scoring the reference logprobs", then="gathering the scored values"):
            block = packed.slice(first, last)
            block_datums = list(datums[first:last]) if datums is not None else None
            local = _score_block(block_datums, reference, block, options.progress and group.rank == 0, guard)
        scored_here = last - first
        value_bounds = [int(packed.offsets[b]) for b in bounds]
        values = group.gather_blocks(local, value_bounds).cpu().numpy()
        if group.rank == 0 and key is not None:
            try:
                write_cache(file, key, values, packed.lengths)
                cache_written = True
            except OSError as error:
                group.warn_once(f"could not write the reference-logprob cache {file!r}: {error}", ReferenceCacheWarning)

    report = ReferenceLogprobsReport(
        source="cache" if status == "hit" else "scored",
        num_datums=count,
        scored_here=scored_here,
        seconds=time.perf_counter() - start,
        cache_path=file,
        cache_status=status,
        cache_key=key,
        reference_fingerprint=fingerprint if fingerprint is not None else stored_reference,
        cache_written=cache_written,
    )
    if group.rank == 0 and status == "hit":
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # shown by Lightning's console logger

        rank_zero_info(f"Reference logprobs of {count:,} datums loaded from the cache {file} (nothing scored)")
    elif group.rank == 0:
        log.info(
            "reference logprobs of %d datums (%d tokens): %s in %.1f s (cache %s: %s)",
            count,
            packed.num_tokens,
            "loaded" if status == "hit" else f"scored on {group.world_size} rank(s)",
            report.seconds,
            file,
            status,
        )
    return values, report


def _check_same_tokens(
    packed: PackedTokens, digest: Callable[[], str], group: _Group, guard: StallGuard, name: Callable[[int], str]
) -> None:
    """``RanksDisagreeError`` on every rank unless all hold the same token ids (see ``check_ranks_agree``)."""
    if group.world_size == 1:
        return
    check_ranks_agree(
        group,
        what="datums",
        count=len(packed),
        digest=digest(),
        item_digests=lambda: token_digests(packed),
        item_name=name,
        guard=guard,
    )


def _describe(status: str, reason: str, path: str | None) -> str:
    """Why a resumed run has no cached values, naming the file (or directory) and the command that lists caches."""
    if status == "missing":
        directory = os.path.dirname(path or "") or "."
        return f"the reference-logprob cache {path} does not exist (nor any other cache in {directory})"
    if status == "stale":
        missing = f" ({path} does not exist)" if path else ""
        return f"no reference-logprob cache was made for this run{missing}: {reason}"
    return f"the reference-logprob cache {path!r} cannot be used ({reason}; `{CACHE_TOOL} list` shows the caches)"


def _shard_bounds(lengths: np.ndarray, unit: int, world_size: int) -> list[int]:
    """Datum index bounds of each rank's block: whole units, about the same number of tokens each.

    A unit goes to the rank whose share of the tokens holds the unit's middle token.

    Example:
        >>> _shard_bounds(np.array([4, 4, 1, 1, 1, 1, 1, 1, 1, 1]), 2, 2)
        [0, 2, 10]
    """
    num_units = len(lengths) // unit
    if num_units == 0:
        return [0] * (world_size + 1)
    unit_tokens = lengths.reshape(num_units, unit).sum(axis=1).astype(np.float64)
    middles = np.cumsum(unit_tokens) - unit_tokens / 2
    targets = unit_tokens.sum() * np.arange(world_size + 1) / world_size
    cuts = np.searchsorted(middles, targets, side="left")
    cuts[0], cuts[-1] = 0, num_units
    return [int(c) * unit for c in cuts]


def _score_block(
    data: list[Any] | None, reference: Any, packed: PackedTokens, progress: bool, guard: StallGuard
) -> torch.Tensor:
    """This rank's values, flat float32: from ``score_packed`` when the reference has it, else via the SDK helper.

    A reference that scores in lock-step (``PolicyReference``) meets the other ranks before each
    forward through ``guard``, so a rank stalled inside a sharded forward is named, not waited for.
    """
    score_packed = getattr(reference, "score_packed", None)
    if callable(score_packed):
        lockstep = {"lockstep": guard} if getattr(reference, "scores_in_lockstep", False) else {}
        with ProgressBar(progress, packed.num_tokens, desc="reference logprobs", unit="tok", unit_scale=True) as bar:
            return score_packed(packed, progress=bar.advance if progress else None, **lockstep).to(torch.float32)
    if data is None:
        raise TypeError(
            f"the reference ({type(reference).__name__}) has no score_packed: it scores datums' model_input "
            "(attach_reference_logprobs), so give the datums (score_across_ranks, or datums=)"
        )
    scored = attach_reference_logprobs(data, reference, progress=progress)
    parts = [_ref_values(datum, first_index) for first_index, datum in enumerate(scored)]
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.float32)


def _reference_fingerprint(reference: Any, given: str | None, group: _Group) -> str | None:
    """The reference's fingerprint, the same on every rank (rank 0's weights win for a torch client)."""
    method = getattr(reference, "fingerprint", None)
    fingerprint = given if given is not None else (method() if callable(method) else None)
    fingerprint = None if fingerprint is None else str(fingerprint)
    if group.world_size == 1:
        return fingerprint
    fingerprints = group.all_gather_objects(fingerprint)
    if len(set(fingerprints)) == 1:
        return fingerprint
    if isinstance(reference, TorchSamplingClient) and isinstance(reference.model, nn.Module) and given is None:
        group.warn_once(
            "the reference weights differ across ranks (an unseeded initialization?); every rank scores with "
            "rank 0's weights, which DDP also gives the policy",
            ReferenceCacheWarning,
        )
        with torch.no_grad():
            for tensor in reference.model.state_dict().values():
                group.broadcast_tensor(tensor)
        return reference.fingerprint()
    raise ValueError(
        f"the reference differs across ranks (fingerprints {fingerprints}); every rank must score with the same one"
    )


def _load(
    path: str | None, key: CacheKey | None, lengths: np.ndarray, group: _Group, *, warn: bool
) -> tuple[np.ndarray | None, str, str, str | None, str | None]:
    """Rank 0 finds the cache and checks it whole; every rank reads it (or receives it); all take the same branch.

    Every rank holds the values in its own memory, read once and checked against rank 0's
    checksum: a file changed or truncated under a running job cannot change its values.
    Returns the values (or ``None``), the lookup's status and reason, the found file's reference,
    and the file the values came from (or belong in).
    """
    if path is None or key is None:
        return None, "off", "", None, None
    lookup = None
    summary: tuple[str, str, bytes | None, str | None, str | None] = ("missing", "", None, None, None)
    if group.rank == 0:
        lookup = find_cache(path, key, lengths)
        if warn and lookup.status == "corrupt":
            run_warnings.warn(
                f"the reference-logprob cache {lookup.path!r} is not used and will be replaced: {lookup.reason}; "
                "scoring again",
                ReferenceCacheWarning,
            )
        elif warn and lookup.status == "stale":
            run_warnings.warn(
                f"no reference-logprob cache matches this run: {lookup.reason}; scoring again and caching the values "
                f"in {lookup.path} (the other caches are kept)",
                ReferenceCacheWarning,
            )
        summary = (
            lookup.status, lookup.reason, lookup.digest, lookup.key.reference if lookup.key else None, lookup.path
        )
    status, reason, digest, stored_reference, file = group.broadcast_object(summary)
    if status != "hit":
        return None, status, reason, stored_reference, file
    if group.rank == 0:
        assert lookup is not None
        flat = lookup.flat
    else:
        assert digest is not None and file is not None
        flat = read_cache(file, key, lengths, digest=digest).flat
    if group.any_true(flat is None):  # a rank that cannot read rank 0's file (no shared file system, or it changed)
        buffer = torch.from_numpy(flat) if group.rank == 0 else torch.empty(int(lengths.sum()), dtype=torch.float32)
        received = group.broadcast_tensor(buffer).numpy()
        flat = flat if group.rank == 0 else received
    return flat, status, reason, stored_reference, file


def _ref_values(datum: Any, index: int) -> np.ndarray:
    field = datum_loss_fn_inputs(datum, index=index)["ref_logprobs"]
    return field_to_tensor(field, where=f"datum {index}, key 'ref_logprobs'").to(torch.float32).cpu().numpy()
