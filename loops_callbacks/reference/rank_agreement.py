"""Every rank holds the same data and settings before any scoring collective: ``check_ranks_agree``.

Ranks that read different data (a node-local copy out of sync, a nondeterministic pipeline)
would each score and train on their own items while sharing one set of reference values: wrong
numbers and no message, or a crash deep in the backend when the counts differ. So each rank sends
one small summary (how many items, one digest of them all, its settings); only when they differ
are the per-item digests gathered, to name the first item that differs and where each rank got
it. The error is raised on every rank alike, before anything is scored or cached.

Examples:
    >>> from loops_callbacks.distributed import ProcessGroup
    >>> digests = item_digests([b"a", b"b"])
    >>> check_ranks_agree(ProcessGroup(), what="datums", count=2, digest=combined_digest(digests),
    ...                   item_digests=lambda: digests, item_name=str)  # one process: always agrees
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from loops_callbacks.distributed import ProcessGroup, StallGuard
from loops_callbacks.reference.packing import PackedTokens

__all__ = [
    "RanksDisagreeError",
    "check_ranks_agree",
    "combined_digest",
    "item_digests",
    "settings_difference",
    "token_digests",
]

_ITEM_DIGEST_SIZE = 16


class RanksDisagreeError(ValueError):
    """The ranks hold different data or settings; every rank raises it before the collectives that need them
    alike (anything scored or cached; a monitor's first step)."""


def item_digests(items: Iterable[bytes]) -> np.ndarray:
    """One 16-byte digest per item, as a ``[N, 16]`` uint8 array.

    Examples:
        >>> item_digests([b"a", b"b"]).shape
        (2, 16)
    """
    rows = [hashlib.blake2b(item, digest_size=_ITEM_DIGEST_SIZE).digest() for item in items]
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), _ITEM_DIGEST_SIZE)


def token_digests(packed: PackedTokens) -> np.ndarray:
    """``item_digests`` of each sequence's token ids (int64, little-endian).

    Examples:
        >>> a = token_digests(PackedTokens.from_sequences([[1, 2], [3]]))
        >>> b = token_digests(PackedTokens.from_sequences([[1, 2], [4]]))
        >>> bool((a[0] == b[0]).all()), bool((a[1] == b[1]).all())
        (True, False)
    """
    ids = packed.ids.astype("<i8", copy=False)
    offsets = packed.offsets
    return item_digests(ids[offsets[i] : offsets[i + 1]].tobytes() for i in range(len(packed)))


def combined_digest(digests: np.ndarray) -> str:
    """One hex digest of every item's digest, in order."""
    return hashlib.sha256(np.ascontiguousarray(digests).tobytes()).hexdigest()


def check_ranks_agree(
    group: ProcessGroup,
    *,
    what: str,
    count: int,
    digest: str,
    item_digests: Callable[[], np.ndarray],
    item_name: Callable[[int], str],
    item_source: Callable[[int], str] | None = None,
    settings: Mapping[str, str] | None = None,
    unit: str = "",
    guard: StallGuard | None = None,
) -> None:
    """Raise ``RanksDisagreeError`` on every rank unless all ranks hold the same items and settings.

    Collective: every rank calls it with its own ``count`` items, their ``digest`` (any string
    that changes with them) and ``settings`` (name to value, e.g. the tokenizer's digest and the
    limits). Only when the items differ are ``item_digests()`` (``[count, k]`` bytes per item)
    gathered, to find the first item that differs: ``item_name(i)`` names it (``pair 5``) and
    ``item_source(i)`` says where each rank got it (``line 6 of pairs.jsonl``). ``unit`` counts
    items in the message (``"pairs"``; default ``what``).
    """
    if group.world_size == 1:
        return
    if guard is not None:
        guard.arrive(f"the check that every rank holds the same {what}")
    unit = unit or what
    summaries = group.all_gather_objects((count, digest, dict(settings or {})))
    listed = settings_difference([named for _, _, named in summaries])
    if listed:
        raise RanksDisagreeError(
            f"the ranks use different settings for their {what} ({listed}). Every rank must use the same ones, or "
            "each scores and trains on other tokens; nothing was scored or cached"
        )
    counts = [number for number, _, _ in summaries]
    if len(set(counts)) == 1 and len({digest for _, digest, _ in summaries}) == 1:
        return
    first = _first_difference(group.all_gather_objects(item_digests()))
    source = item_source(first) if item_source is not None and first < count else None
    sources = group.all_gather_objects(source if first < count else f"none ({count} {unit})")
    where = ", ".join(f"rank {rank}: {text}" for rank, text in enumerate(sources) if text is not None)
    held = ", ".join(f"rank {rank}: {number} {unit}" for rank, number in enumerate(counts))
    verb = "read" if "records" in what else "hold"
    raise RanksDisagreeError(
        f"the ranks {verb} different {what} ({held}); the first difference is {item_name(first)}"
        f"{': ' + where if where else ''}. Every rank must read the same data (a node-local copy out of date? a "
        "nondeterministic pipeline?), or each trains on reference values made for other data; nothing was scored "
        "or cached"
    )


def settings_difference(per_rank: Sequence[Mapping[str, str]]) -> str:
    """Each setting whose value differs between the ranks, with every rank's value; ``""`` when they agree.

    Examples:
        >>> settings_difference([{"max_length": "64", "seed": "0"}, {"max_length": "48", "seed": "0"}])
        'max_length: rank 0: 64, rank 1: 48'
    """
    names = sorted({name for named in per_rank for name in named})
    differing = [name for name in names if len({named.get(name) for named in per_rank}) > 1]
    return "; ".join(
        f"{name}: " + ", ".join(f"rank {rank}: {named.get(name)}" for rank, named in enumerate(per_rank))
        for name in differing
    )


def _first_difference(everyone: list[np.ndarray]) -> int:
    """The first index where some rank's digest differs from rank 0's (or where the shorter ones end).

    Examples:
        >>> a, b = item_digests([b"x", b"y"]), item_digests([b"x", b"z", b"w"])
        >>> _first_difference([a, b]), _first_difference([a, b[:1]])
        (1, 1)
    """
    shortest = min(len(digests) for digests in everyone)
    first = shortest
    for digests in everyone[1:]:
        differ = np.flatnonzero((digests[:shortest] != everyone[0][:shortest]).any(axis=1))
        if differ.size:
            first = min(first, int(differ[0]))
    return first
