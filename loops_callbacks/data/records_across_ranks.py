"""Preference records checked alike on every rank, then tokenized once across the ranks: ``tokenize_across_ranks``.

Under DDP every rank needs every pair (to score its share of the reference logprobs and to give
Lightning's sampler the whole data set). Each rank reads the records, then, in order:

1. the ranks compare what they read (``check_ranks_agree``): the records (a digest of each one's
   JSON), the limits, and the tokenizer (a digest of its serialization and chat template). Ranks
   that differ raise ``RanksDisagreeError`` naming the first differing pair and where each rank
   read it, before any tokenizing, scoring or caching;
2. rank r tokenizes only the r-th contiguous share of the records (``tokenize_records``, as
   ``preference_pairs`` in one process), so the work on a node does not grow with its ranks;
3. the shares' packed pairs (flat arrays, no datum) and reports are gathered and put back in
   order: every rank gets what one process tokenizing every record gets, the same token ids and
   the same report.

In one process it is ``preference_pairs`` itself.

Examples:
    >>> from loops_callbacks.data.sources import read_preference_records
    >>> records = read_preference_records([{"chosen": [1, 2, 3], "rejected": [1, 2, 4], "prompt_length": 2}])
    >>> pairs, report = tokenize_across_ranks(records, None, progress=False)
    >>> pairs.input_ids.tolist(), pairs.offsets.tolist(), report.record_indices
    ([1, 2, 3, 1, 2, 4], [0, 3, 6], [0])
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.data.preference import parse_preference
from loops_callbacks.data.sources import LocatedRecord
from loops_callbacks.data.tokenization import TokenizationReport, kept_pairs, tokenize_records
from loops_callbacks.data.tokenizer import load_tokenizer, tokenizer_digests
from loops_callbacks.distributed import ProcessGroup, StallGuard, fail_together
from loops_callbacks.reference.rank_agreement import check_ranks_agree, combined_digest, item_digests



def record_digests(records: Sequence[LocatedRecord]) -> np.ndarray:
    """One digest per record, of its JSON with sorted keys (where it was read is left out).

    Examples:
        >>> a = record_digests([LocatedRecord({"chosen": "x", "rejected": "y"}, "line 1 of a.jsonl")])
        >>> b = record_digests([LocatedRecord({"rejected": "y", "chosen": "x"}, "line 1 of b.jsonl")])
        >>> bool((a == b).all())
        True
    """
    return item_digests(json.dumps(item.record, sort_keys=True, ensure_ascii=False, default=_plain).encode()
                        for item in records)


def _plain(value: Any) -> Any:
    """Arrays and numpy scalars (a ``datasets`` or parquet record) as JSON values."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return repr(value)


def tokenize_across_ranks(records: Sequence[LocatedRecord], tokenizer: Any, *, max_length: int | None = None,
                          max_prompt_length: int | None = None, progress: bool = True, timeout: float | None = None
                          ) -> tuple[PackedPairs, TokenizationReport]:
    """``preference_pairs(records, ...)``, each rank tokenizing 1/world_size of the records, after checking they agree.

    Collective: call it on every rank with what that rank read. Raises ``RanksDisagreeError``
    on every rank when the records, the limits or the tokenizer differ across ranks, and any
    rank's tokenizing error (a bad record) on every rank. ``timeout``: seconds a rank waits for
    the others at each step (``StallGuard``).
    """
    group = ProcessGroup()
    if group.world_size == 1:
        return kept_pairs(*tokenize_records(records, tokenizer, max_length=max_length,
                                            max_prompt_length=max_prompt_length, progress=progress))
    guard = StallGuard(group, timeout)
    digests = record_digests(records)
    check_ranks_agree(group, what="preference records", unit="pairs", count=len(records),
                      digest=combined_digest(digests), item_digests=lambda: digests,
                      item_name=lambda index: f"pair {index}", item_source=lambda index: records[index].where,
                      settings={"max_length": str(max_length), "max_prompt_length": str(max_prompt_length)}, guard=guard)
    with fail_together(guard, "loading the tokenizer", then="loading the tokenizer"):
        loaded = _tokenizer_for(records, tokenizer)
        digests = {} if loaded is None else tokenizer_digests(loaded)
    check_ranks_agree(group, what="preference records", count=0, digest="",
                      item_digests=lambda: np.zeros((0, 16), np.uint8), item_name=str, settings=digests)
    bounds = [len(records) * rank // group.world_size for rank in range(group.world_size + 1)]
    first, last = bounds[group.rank], bounds[group.rank + 1]
    guard.note(f"tokenizing its share of the preference records ({first} to {last - 1} of {len(records)})")
    with fail_together(guard, "tokenizing the preference records", then="gathering the tokenized preference pairs"):
        share = tokenize_records(records[first:last], loaded, max_length=max_length,
                                 max_prompt_length=max_prompt_length, progress=progress and group.rank == 0)
    shares = group.all_gather_objects(share)  # flat arrays: a few objects a share
    return kept_pairs(PackedPairs.concatenate([part for part, _ in shares]),
                      _joined([report for _, report in shares], bounds))


def _tokenizer_for(records: Sequence[LocatedRecord], tokenizer: Any) -> Any:
    """The tokenizer object (loaded once here, for every share), or ``None`` when no record is text."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    needed = any(parse_preference(item.record, item.where).format != "token_ids" for item in records)
    return load_tokenizer(tokenizer) if needed else None


def _joined(reports: list[TokenizationReport], bounds: list[int]) -> TokenizationReport:
    """The report of all the shares in order: counts added, record indices shifted, first examples kept."""
    joined = TokenizationReport()
    for report, first in zip(reports, bounds):
        for name, theirs in vars(report).items():
            mine = getattr(joined, name)
            if name == "record_indices":
                mine.extend(first + index for index in theirs)
            elif name == "formats":
                mine.update({key: mine.get(key, 0) + count for key, count in theirs.items()})
            elif name == "examples":
                joined.examples = {**theirs, **mine}  # the first share's example of each event
            else:
                setattr(joined, name, mine + theirs)
    return joined
