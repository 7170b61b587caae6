"""See and prune the reference-logprob caches of a directory: ``loops-callbacks cache``.

Each run caches its reference logprobs in a file of its own (one per reference, data and scoring
dtype), so a directory shared by experiments keeps all of them until they are pruned (``python -m
loops_callbacks.reference.cache_tool`` is the same command)::

    loops-callbacks cache list runs/dpo/reference_logprobs
    loops-callbacks cache prune runs/dpo/reference_logprobs --older-than 30
    loops-callbacks cache prune runs/dpo/reference_logprobs --keep-newest 2 --dry-run

``list`` shows each file's size, date and key (reference weights, data, scoring dtype: the first
12 hex digits of each fingerprint); ``prune`` removes the files it selects, and says which. A
running job holds its values in memory, so pruning its file does not change or stop it (a run
resumed later needs its file: prune what no run will resume).

Example:
    >>> import tempfile
    >>> main(["list", tempfile.mkdtemp()])  # doctest: +ELLIPSIS
    no reference-logprob caches in ...
    0
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
import time
from collections.abc import Sequence

from loops_callbacks.reference.cache import CACHE_TOOL, CacheInfo, list_caches, orphaned_temporaries

__all__ = ["main", "select_for_pruning"]


def select_for_pruning(
    caches: Sequence[CacheInfo],
    *,
    older_than_days: float | None = None,
    keep_newest: int | None = None,
    damaged: bool = False,
    now: float | None = None,
) -> list[CacheInfo]:
    """The caches a ``prune`` with these options removes: any file that one of the given options selects.

    Example:
        >>> old, new = CacheInfo("a", 1, 0.0, None), CacheInfo("b", 1, 86400.0 * 40, None)
        >>> [c.path for c in select_for_pruning([new, old], older_than_days=30, now=86400.0 * 41)]
        ['a']
        >>> [c.path for c in select_for_pruning([new, old], keep_newest=1)]
        ['a']
    """
    now = time.time() if now is None else now
    newest_first = sorted(caches, key=lambda info: -info.modified)
    chosen: list[CacheInfo] = []
    for rank, info in enumerate(newest_first):
        too_old = older_than_days is not None and now - info.modified > older_than_days * 86400
        beyond = keep_newest is not None and rank >= keep_newest
        if too_old or beyond or (damaged and (info.key is None or info.problem)):
            chosen.append(info)
    return chosen


def _line(info: CacheInfo) -> str:
    if info.key is None:
        return f"{info.describe()}  unreadable: {info.problem}"
    reference = (info.key.reference or "?")[:12]
    fields = f"reference {reference}  data {info.key.data[:12]}  dtype {info.key.dtype}"
    counts = f"{info.num_datums:,} datums, {info.num_values:,} tokens"
    return f"{info.describe()}  {fields}  {counts}{'  DAMAGED: ' + info.problem if info.problem else ''}"


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more, got {text!r}")
    return value


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of days, 0 or more, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (0: done, 1: an entry to prune was left, and why is said,
    2: bad arguments)."""
    parser = argparse.ArgumentParser(
        prog=CACHE_TOOL,
        description="See and prune the reference-logprob caches of a directory (one file per reference weights, "
        "data and scoring dtype; a DPO run's cache_dir, by default <default_root_dir>/reference_logprobs).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every cache in DIR: size, date, key").add_argument("directory", metavar="DIR")
    prune = commands.add_parser("prune", help="remove the caches of DIR that the options select")
    prune.add_argument("directory", metavar="DIR")
    prune.add_argument("--older-than", type=_days, metavar="DAYS", help="remove those not modified for DAYS days")
    prune.add_argument("--keep-newest", type=_count, metavar="N", help="remove all but the N newest")
    prune.add_argument(
        "--damaged",
        action="store_true",
        help="remove files with an unreadable header or a wrong size, and temporary files of killed writers",
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        parser.error(f"{args.directory} {'is not a directory' if os.path.exists(args.directory) else 'does not exist'}")
    caches = list_caches(args.directory)
    orphans = orphaned_temporaries(args.directory)
    orphan_bytes = sum(_size(orphan) for orphan in orphans)
    if args.command == "list":
        if not caches:
            print(f"no reference-logprob caches in {args.directory}")
        for info in caches:
            print(_line(info))
        if orphans:
            print(f"{len(orphans)} temporary file(s) of killed writers ({orphan_bytes / (1 << 20):.1f} MB): "
                  "prune --damaged removes them")
        return 0
    if args.older_than is None and args.keep_newest is None and not args.damaged:
        parser.error("prune needs --older-than DAYS, --keep-newest N or --damaged (nothing is removed by default)")
    chosen = select_for_pruning(
        caches, older_than_days=args.older_than, keep_newest=args.keep_newest, damaged=args.damaged
    )
    verb = "would remove" if args.dry_run else "removed"
    left: dict[str, str] = {}  # what could not be removed, and why
    for path in [info.path for info in chosen] + (orphans if args.damaged else []):
        why = "" if args.dry_run else _remove(path)
        if why:
            left[path] = why
    removed = [info for info in chosen if info.path not in left]
    for info in removed:
        print(f"{verb} {_line(info)}")
    freed = sum(info.size for info in removed) / (1 << 20)
    print(f"{len(removed)} of {len(caches)} caches {'selected' if args.dry_run else 'removed'} ({freed:.1f} MB)")
    if args.damaged and orphans:
        gone = [orphan for orphan in orphans if orphan not in left]
        print(f"{verb} {len(gone)} temporary file(s) of killed writers ({sum(map(_size, gone)) / (1 << 20):.1f} MB)")
    for path, why in left.items():
        print(f"left {os.path.basename(path)}: {why}")
    return 1 if left else 0


def _size(path: str) -> int:
    """The bytes a directory entry holds: a regular file's size, 0 for a link (never followed) or a directory."""
    try:
        status = os.lstat(path)
    except OSError:
        return 0
    return status.st_size if stat.S_ISREG(status.st_mode) else 0


def _remove(path: str) -> str:
    """Remove a directory entry without following a link (a link goes, not its target); why not, if it stays.

    A directory is removed only when empty: one that holds files was not made by a cache writer.
    """
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        return ""  # gone meanwhile
    except OSError as error:
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return "a directory that is not empty (not made by a cache writer): remove it yourself if it is not needed"
        return f"it cannot be removed ({error.strerror or error})"
    return ""


if __name__ == "__main__":
    sys.exit(main())
