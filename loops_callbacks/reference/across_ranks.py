"""Reference logprobs scored once across ranks and cached on disk: ``score_across_ranks``.

It knows datums and token ids, not what the data mean (DPO pairs are checked by the caller,
``loops_callbacks.data``). In order:

1. the cache key is made: the reference's fingerprint (its weights, or the ``reference_fingerprint``
   you give for a client whose weights cannot be read here), the token data and the scoring dtype;
2. rank 0 reads the cache file; a whole file for this key is used and nothing is scored; a file
   for another key (changed reference or data) or a damaged one is warned about and replaced;
3. otherwise each rank scores only its shard (units of ``shard_unit`` datums, dealt in turn) with
   ``attach_reference_logprobs`` (a progress bar on rank 0), and the results are gathered on every
   rank (``torch.distributed.all_gather_object``); rank 0 writes the cache (temporary file +
   ``os.replace``);
4. every rank gets the same new datums, as ``attach_reference_logprobs`` returns them.
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

from loops_callbacks.fields import datum_loss_fn_inputs, field_to_tensor
from loops_callbacks.reference.attach import attach_reference_logprobs
from loops_callbacks.reference.cache import CacheKey, data_fingerprint, read_cache, write_cache
from loops_callbacks.reference.clients import TorchSamplingClient

__all__ = ["ReferenceCacheWarning", "ReferenceLogprobsReport", "score_across_ranks"]

log = logging.getLogger(__name__)


class ReferenceCacheWarning(UserWarning):
    """The reference-logprob cache could not be used (stale or damaged) or written, or is off."""


@dataclass
class ReferenceLogprobsReport:
    """What ``score_across_ranks`` did, as seen from this rank.

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


def score_across_ranks(
    data: Sequence[Any],
    reference: Any,
    tokens: Sequence[Sequence[int]],
    *,
    cache_path: str | os.PathLike[str] | None = None,
    reference_fingerprint: str | None = None,
    scoring_dtype: str | None = None,
    progress: bool = True,
    shard_unit: int = 1,
) -> tuple[list[Any], ReferenceLogprobsReport]:
    """``attach_reference_logprobs(data, reference)``, scored once across ranks and cached on disk.

    Call it on every rank of an initialized ``torch.distributed`` group (or in a single process)
    with the same ``data``, already checked by the caller, and ``tokens`` (each datum's token ids,
    used for the cache key and the lengths). The datums are dealt to the ranks in units of
    ``shard_unit`` consecutive datums (unit u on rank ``u % world_size``) and all ranks get every
    result. Without a ``cache_path``, or without a fingerprint for ``reference`` (a
    client with no ``fingerprint()`` method and no ``reference_fingerprint`` given), nothing is
    cached.

    Args:
        data: the datums to score.
        reference: a ``SamplingClient``; a ``TorchSamplingClient`` whose weights differ across
            ranks is given rank 0's weights first (as DDP does to the policy).
        tokens: ``data``'s token ids, one list per datum.
        cache_path: the cache file (read by rank 0, written by rank 0).
        reference_fingerprint: the reference's identity when ``reference`` has no ``fingerprint()``
            (e.g. the checkpoint path a remote sampler serves).
        scoring_dtype: part of the cache key (``None`` means the model's own dtype).
        progress: a progress bar on rank 0 while scoring.
        shard_unit: datums that stay together on one rank (2 keeps a DPO pair's two sequences
            together); ``len(data)`` must be a multiple of it.

    Returns:
        The new datums (in ``data``'s order) and a ``ReferenceLogprobsReport``.

    Example:
        >>> from loops_callbacks.types import Datum, ModelInput
        >>> class Flat:
        ...     def compute_logprobs(self, prompt):
        ...         return [None] + [-0.5] * (prompt.length - 1)
        >>> data = [Datum(ModelInput.from_ints([1, 2, 3]))]
        >>> scored, report = score_across_ranks(data, Flat(), [[1, 2, 3]], progress=False)
        >>> scored[0].loss_fn_inputs["ref_logprobs"].data, report.source
        ([-0.5, -0.5, 0.0], 'scored')
    """
    start = time.perf_counter()
    data = list(data)
    if len(data) % shard_unit:
        raise ValueError(f"score_across_ranks: {len(data)} datums are not a whole number of units of {shard_unit}")
    group = _Group()
    fingerprint = _reference_fingerprint(reference, reference_fingerprint, group)
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
        units = range(group.rank, len(data) // shard_unit, group.world_size)
        mine = [unit * shard_unit + offset for unit in units for offset in range(shard_unit)]
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


