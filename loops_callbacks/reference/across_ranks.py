"""Reference logprobs scored once across ranks and cached on disk: ``score_across_ranks``.

Token ids in, one float32 array of values out (the ``ref_logprobs`` layout: value k of a sequence
is log p(token k + 1 | tokens up to k), its last value 0). It knows token ids, not what the data
mean (DPO pairs are checked by the caller, ``loops_callbacks.data``). In order:

1. the ranks compare their token ids (a count and one digest each, ``check_ranks_agree``): ranks
   that hold different data raise ``RanksDisagreeError`` on every rank, naming the first sequence
   that differs, before anything is scored or cached; then every id is checked once against the
   reference's vocabulary (``check_token_ids``; the scorers take the checked form). The cache key
   is made: the reference's fingerprint (its weights, or the ``reference_fingerprint`` given for a
   client whose weights cannot be read here), the token data and the scoring dtype;
2. rank 0 finds this key's cache file (``find_cache``) and checks it whole; then nothing is
   scored: every rank reads it into its own memory and checks that what it read has rank 0's
   checksum, or, where a rank cannot, receives rank 0's values. A damaged file is warned about and
   replaced; caches of other keys (reference, data, dtype) are named in a warning and kept;
3. otherwise each rank scores one contiguous block of whole *shard units* (``shard_unit``
   consecutive sequences that always go to the same rank: 2 for a DPO pair's chosen and rejected)
   with about the same number of tokens as every other rank's: with ``score_packed`` when the reference has it
   (``TorchSamplingClient``, ``PolicyReference``, which scores in lock-step), else through the SDK's
   calls (``score_prompts``: remote clients). The blocks are gathered into one float32 tensor on
   every rank, and rank 0 writes the cache.

With ``cache_only_reason`` nothing is scored: the values must come from the cache (a resumed run whose
reference was the initial policy), and a missing or mismatching file is a ``ReferenceCacheError``.
Before each collective step the ranks meet (``StallGuard``): a rank that does not come within
``scoring_timeout`` seconds is named, with the step, by a ``RankStalledError`` on every rank.

Examples:
    >>> client = TorchSamplingClient(torch.nn.Sequential(torch.nn.Embedding(8, 8)))
    >>> values, report = score_across_ranks([[1, 2], [3]], client, ReferenceConfig(progress=False))
    >>> values.dtype, values.tolist()[1:], report.source, report.cache_status
    (dtype('float32'), [0.0, 0.0], 'scored', 'off')
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.fields import datum_model_input
from loops_callbacks.progress import ProgressBar
from loops_callbacks.reference.attach import score_prompts
from loops_callbacks.reference.cache import (CACHE_FILE_NAME, CACHE_TOOL, CacheKey, CacheLookup, data_fingerprint,
                                             find_cache, read_cache, write_cache)
from loops_callbacks.reference.clients import TorchSamplingClient
from loops_callbacks.distributed import ProcessGroup, StallGuard, fail_together
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.packing import PackedTokens, check_token_ids
from loops_callbacks.reference.rank_agreement import check_ranks_agree, token_digests
from loops_callbacks.types import ModelInput
from loops_callbacks.validation import check_int, check_reference_logprobs

__all__ = ["ReferenceCacheError", "ReferenceCacheWarning", "ReferenceLogprobsReport", "score_across_ranks"]


class ReferenceCacheWarning(UserWarning):
    """The reference-logprob cache could not be used (stale or damaged) or written, or is off."""


class ReferenceCacheError(RuntimeError):
    """The values had to come from the cache (``cache_only_reason``) and it is missing or does not match."""


@dataclass
class ReferenceLogprobsReport:
    """What ``score_across_ranks`` did, as seen from this rank.

    ``source`` is ``"cache"`` (loaded, nothing scored) or ``"scored"``; ``scored_here`` counts the
    sequences this rank scored; ``cache_status`` is the lookup's outcome (``"hit"``, ``"missing"``,
    ``"stale"``, ``"corrupt"``, or ``"off"`` without a cache); ``cache_key`` is the key the values
    are (or would be) cached under, in ``cache_path``; ``cache_written`` says that this rank wrote
    them (rank 0 writes; a failed write is a warning).
    """

    source: Literal["cache", "scored"]
    n_datums: int
    scored_here: int
    seconds: float
    cache_path: str | None
    cache_status: str
    cache_key: CacheKey | None = None
    reference_fingerprint: str | None = None
    cache_written: bool = False


def score_across_ranks(
    tokens: PackedTokens | Sequence[Sequence[int]],
    reference: Any,
    config: ReferenceConfig | None = None,
    *,
    datums: Sequence[Any] | None = None,
    cache_tag: str | None = None,
    cache_only_reason: str | None = None,
    shard_unit: int = 1,
    datum_name: Callable[[int], str] | None = None,
) -> tuple[np.ndarray, ReferenceLogprobsReport]:
    """The reference values of every sequence of ``tokens``, scored once across ranks and cached (module docstring).

    Call it on every rank of an initialized ``torch.distributed`` group (or in a single process)
    with the same ``tokens``. Sequence i's values are ``values[offsets[i]:offsets[i + 1]]``.

    Args:
        tokens: the token ids, packed (or one list per sequence).
        reference: a ``SamplingClient``; a ``TorchSamplingClient`` whose weights differ across ranks
            is given rank 0's weights first (as DDP does to the policy). Unused with ``cache_only_reason``.
        config: the settings (``cache_dir``: no cache when ``None``; ``reference_fingerprint``: the
            reference's identity when it has no ``fingerprint()``, or with ``cache_only_reason`` the
            identity the cached values must have, ``None`` for any; ``progress``; ``scoring_timeout``).
        datums: the sequences as datums, for a reference without ``score_packed``: it is called
            with their own ``model_input`` (default: ``ModelInput``\\ s of ``tokens``).
        cache_tag: the cache key's ``dtype`` (``CacheKey``), what the values depend on besides the
            reference's weights and the data (default ``config.cache_tag()``; ``policy_tag`` for the policy).
        cache_only_reason: never score, the cache must hold the values; the text says why (and how to
            fix a miss) and ends the ``ReferenceCacheError`` message.
        shard_unit: the shard unit, sequences that always go to the same rank (2: a DPO pair's two).
        datum_name: how an error names sequence ``i`` (default ``datum i``), e.g. ``datum_label``.
    """
    start = time.perf_counter()
    config = config if config is not None else ReferenceConfig()
    tokens = tokens if isinstance(tokens, PackedTokens) else PackedTokens.from_sequences(tokens)
    count = len(tokens)
    if count % check_int("shard_unit", shard_unit, least=1):
        raise ValueError(f"score_across_ranks: {count} datums are not a whole number of units of {shard_unit}")
    if datums is not None and len(datums) != count:
        raise ValueError(f"score_across_ranks: {count} token sequences for {len(datums)} datums")
    group = ProcessGroup()
    guard = StallGuard(group, config.scoring_timeout)
    digest = functools.cache(functools.partial(data_fingerprint, tokens))  # compared across ranks, and in the key
    name = datum_name or (lambda index: f"datum {index}")
    if group.world_size > 1:
        check_ranks_agree(group, what="datums", count=count, digest=digest(), item_digests=lambda: token_digests(tokens),
                          item_name=name, guard=guard)
    tokens = check_token_ids(tokens, getattr(reference, "vocab_size", None), datum_name=name)  # the one check
    path = os.path.join(config.cache_dir, CACHE_FILE_NAME) if config.use_cache and config.cache_dir else None
    if cache_only_reason is not None and path is None:
        raise ReferenceCacheError("there is no reference-logprob cache to read (the cache is off): "
                                  f"{cache_only_reason}")
    fingerprint = config.reference_fingerprint
    if cache_only_reason is None:
        guard.arrive("the reference's fingerprint")
        fingerprint = _reference_fingerprint(reference, fingerprint, group)
        if path is not None and fingerprint is None:
            run_warnings.warn(f"the reference ({type(reference).__name__}) has no fingerprint() and no "
                              "reference_fingerprint was given, so its logprobs are not cached and will be scored "
                              "again on every run", ReferenceCacheWarning)
            path = None
    key = CacheKey(fingerprint, digest(), cache_tag or config.cache_tag()) if path is not None else None
    lookup = _load(path, key, tokens.lengths, group, warn=cache_only_reason is None)
    values, file = lookup.flat, lookup.path
    if values is None and cache_only_reason is not None:
        raise ReferenceCacheError(f"{_describe(lookup.status, lookup.reason, file or path)}: {cache_only_reason}")
    scored_here, written = 0, False
    if values is None:
        bounds = _shard_bounds(tokens.lengths, shard_unit, group.world_size)
        first, last = bounds[group.rank], bounds[group.rank + 1]
        guard.note(f"scoring its block (datums {first} to {last - 1} of {count})")
        with fail_together(guard, "scoring the reference logprobs", then="gathering the scored values"):
            block_datums = None if datums is None else datums[first:last]
            show = config.progress and group.rank == 0
            local = _score_block(reference, tokens.slice(first, last), block_datums, show, guard)
        scored_here = last - first
        values = group.gather_blocks(local, [int(tokens.offsets[b]) for b in bounds]).cpu().numpy()
        # every rank holds every value: all refuse together what a reference of its own gave (its score_packed)
        check_reference_logprobs(values, where="the reference's logprobs", lengths=tokens.lengths)
        if group.rank == 0 and key is not None:
            try:
                write_cache(file, key, values, tokens.lengths)
                written = True
            except OSError as error:
                run_warnings.warn(f"could not write the reference-logprob cache {file!r}: {error}",
                                  ReferenceCacheWarning)
    hit = lookup.status == "hit"
    report = ReferenceLogprobsReport("cache" if hit else "scored", count, scored_here, time.perf_counter() - start,
                                     file, lookup.status, key,
                                     fingerprint if fingerprint is not None else lookup.key and lookup.key.reference,
                                     written)
    if group.rank == 0 and hit:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info  # shown by Lightning's console logger

        rank_zero_info(f"Reference logprobs of {count:,} datums loaded from the cache {file} (nothing scored)")
    return values, report


def _describe(status: str, reason: str, path: str | None) -> str:
    """Why a resumed run has no cached values, naming the file (or directory) and the command that lists caches."""
    if status == "missing":
        directory = os.path.dirname(path or "") or "."
        return f"the reference-logprob cache {path} does not exist (nor any other cache in {directory})"
    if status == "stale":
        return f"no reference-logprob cache was made for this run{f' ({path} does not exist)' if path else ''}: {reason}"
    return f"the reference-logprob cache {path!r} cannot be used ({reason}; `{CACHE_TOOL} list` shows the caches)"


def _shard_bounds(lengths: np.ndarray, unit: int, world_size: int) -> list[int]:
    """Sequence index bounds of each rank's block: whole units, about the same number of tokens each (a unit goes
    to the rank whose share of the tokens holds the unit's middle token).

    Examples:
        >>> _shard_bounds(np.array([4, 4, 1, 1, 1, 1, 1, 1, 1, 1]), 2, 2)
        [0, 2, 10]
    """
    num_units = len(lengths) // unit
    if num_units == 0:
        return [0] * (world_size + 1)
    unit_tokens = lengths.reshape(num_units, unit).sum(axis=1).astype(np.float64)
    middles = np.cumsum(unit_tokens) - unit_tokens / 2
    cuts = np.searchsorted(middles, unit_tokens.sum() * np.arange(world_size + 1) / world_size, side="left")
    cuts[0], cuts[-1] = 0, num_units
    return [int(c) * unit for c in cuts]


def _score_block(reference: Any, tokens: PackedTokens, datums: Sequence[Any] | None, progress: bool,
                 guard: StallGuard) -> torch.Tensor:
    """This rank's values, flat float32: from ``score_packed`` when the reference has it, else the SDK's calls.

    A reference that scores in lock-step (``PolicyReference``) meets the other ranks before each
    forward through ``guard``, so a rank stalled inside a sharded forward is named, not waited for.
    """
    score_packed = getattr(reference, "score_packed", None)
    if callable(score_packed):
        lockstep = {"lockstep": guard} if getattr(reference, "scores_in_lockstep", False) else {}
        with ProgressBar(progress, tokens.num_tokens, desc="reference logprobs", unit="tok", unit_scale=True) as bar:
            return score_packed(tokens, progress=bar.advance if progress else None, **lockstep).to(torch.float32)
    if datums is not None:
        prompts = [datum_model_input(datum) for datum in datums]
    else:
        prompts = [ModelInput.from_ints(tokens.ids[a:b].tolist()) for a, b in zip(tokens.offsets, tokens.offsets[1:])]
    values = score_prompts(prompts, reference, progress=progress)
    return torch.from_numpy(np.concatenate(values).astype(np.float32) if values else np.zeros(0, np.float32))


def _reference_fingerprint(reference: Any, given: str | None, group: ProcessGroup) -> str | None:
    """The reference's fingerprint, the same on every rank (rank 0's weights win for a torch client)."""
    method = getattr(reference, "fingerprint", None)
    fingerprint = given if given is not None else (method() if callable(method) else None)
    fingerprint = None if fingerprint is None else str(fingerprint)
    fingerprints = group.all_gather_objects(fingerprint)
    if len(set(fingerprints)) == 1:
        return fingerprint
    if isinstance(reference, TorchSamplingClient) and isinstance(reference.model, nn.Module) and given is None:
        run_warnings.warn("the reference weights differ across ranks (an unseeded initialization?); every rank "
                          "scores with rank 0's weights, which DDP also gives the policy", ReferenceCacheWarning)
        with torch.no_grad():
            for tensor in reference.model.state_dict().values():
                group.broadcast_tensor(tensor)
        return reference.fingerprint()
    raise ValueError(f"the reference differs across ranks (fingerprints {fingerprints}); every rank must score "
                     "with the same one")


def _load(path: str | None, key: CacheKey | None, lengths: np.ndarray, group: ProcessGroup, *, warn: bool) -> CacheLookup:
    """Rank 0 finds the cache and checks it whole; every rank reads it (or receives it); all take the same branch.

    Every rank holds the values in its own memory (``flat``), read once and checked against rank
    0's checksum: a file changed or truncated under a running job cannot change its values. Every
    rank gets rank 0's lookup otherwise (``status`` ``"off"`` without a cache).
    """
    if path is None or key is None:
        return CacheLookup("off")
    lookup = find_cache(path, key, lengths) if group.rank == 0 else None
    if warn and lookup is not None and lookup.status == "corrupt":
        run_warnings.warn(f"the reference-logprob cache {lookup.path!r} is not used and will be replaced: "
                          f"{lookup.reason}; scoring again", ReferenceCacheWarning)
    elif warn and lookup is not None and lookup.status == "stale":
        run_warnings.warn(f"no reference-logprob cache matches this run: {lookup.reason}; scoring again and "
                          f"caching the values in {lookup.path} (the other caches are kept)", ReferenceCacheWarning)
    shared = group.broadcast_object(lookup and dataclasses.replace(lookup, flat=None))  # small metadata only
    if shared.status != "hit":
        return shared
    flat = lookup.flat if lookup is not None else read_cache(shared.path, key, lengths, digest=shared.digest).flat
    if group.any_true(flat is None):  # a rank that cannot read rank 0's file (no shared file system, or it changed)
        buffer = torch.from_numpy(flat) if group.rank == 0 else torch.empty(int(lengths.sum()), dtype=torch.float32)
        received = group.broadcast_tensor(buffer).numpy()
        flat = flat if group.rank == 0 else received
    return dataclasses.replace(shared, flat=flat)
