"""The command that lists and prunes the reference-logprob caches of a directory, ``loops-callbacks cache``
(``python -m loops_callbacks cache`` is the same)::

    loops-callbacks cache list runs/dpo/reference_logprobs
    loops-callbacks cache prune runs/dpo/reference_logprobs --older-than 30
    loops-callbacks cache prune runs/dpo/reference_logprobs --keep-newest 2 --dry-run

Each run caches its reference logprobs in a file of its own (one per reference, data and scoring
dtype), so a directory shared by experiments keeps all of them until they are pruned. ``list``
shows each file's size, date and key (reference weights, data, scoring dtype: the first 12 hex
digits of each fingerprint); ``prune`` removes the files it selects, and says which. A running job
holds its values in memory, so pruning its file does not change or stop it (a run resumed later
needs its file: prune what no run will resume).

A cache is told by its header, never by its name: ``prune`` selects only files this package wrote
(``CacheInfo.ours``). Every other entry named ``*.cache`` (another program's file, a directory, a
symbolic link, a file that cannot be read) is listed as not ours and left as it is, and so is a file
that is no longer the one listed when its turn comes (a run wrote its cache anew meanwhile).

Examples:
    >>> import os, tempfile
    >>> import numpy as np
    >>> from loops_callbacks.reference.cache import CACHE_FILE_NAME, CacheKey, cache_file, data_fingerprint, write_cache
    >>> key = CacheKey(reference="r", data=data_fingerprint([[1, 2], [3]]), dtype="float32")
    >>> base = os.path.join(tempfile.mkdtemp(), CACHE_FILE_NAME)
    >>> write_cache(cache_file(base, key), key, [np.array([-0.5, 0.0]), np.array([0.0])])
    >>> main(["list", os.path.dirname(base)])  # doctest: +ELLIPSIS
    ref_logprobs....cache (0.0 MB, ...)  reference r  data ...  dtype float32  2 datums, 3 tokens
    0
"""

from __future__ import annotations

import argparse
import os
import stat
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


from loops_callbacks.reference.cache import CACHE_TOOL, CacheInfo, list_caches, orphaned_temporaries, read_stored

__all__ = ["main", "select_for_pruning"]

def select_for_pruning(
    caches: Sequence[CacheInfo],
    *,
    older_than_days: float | None = None,
    keep_newest: int | None = None,
    damaged: bool = False,
    now: float | None = None,
) -> list[CacheInfo]:
    """The caches a ``prune`` with these options removes: any of ours (``CacheInfo.ours``) that one of the given
    options selects; ``keep_newest`` counts ours only. Nothing else is ever selected.

    Examples:
        >>> old, new = CacheInfo("a", 1, 0.0, None, ours=True), CacheInfo("b", 1, 86400.0 * 40, None, ours=True)
        >>> [c.path for c in select_for_pruning([new, old], older_than_days=30, now=86400.0 * 41)]
        ['a']
        >>> [c.path for c in select_for_pruning([new, old], keep_newest=1)]
        ['a']
        >>> select_for_pruning([CacheInfo("notes.cache", 1, 0.0, None)], keep_newest=0, damaged=True)
        []
    """
    now = time.time() if now is None else now
    newest_first = sorted((info for info in caches if info.ours), key=lambda info: -info.modified)
    chosen: list[CacheInfo] = []
    for rank, info in enumerate(newest_first):
        too_old = older_than_days is not None and now - info.modified > older_than_days * 86400
        beyond = keep_newest is not None and rank >= keep_newest
        if too_old or beyond or (damaged and (info.key is None or info.problem)):
            chosen.append(info)
    return chosen


def _line(info: CacheInfo) -> str:
    """``list``'s line of an entry: its name, size and date, then its key (or why there is none)."""
    if not info.ours:
        fields = f"  {_key_fields(info)}" if info.key is not None else ""
        return f"{info.describe()}{fields}  not ours, left alone: {_not_ours(info)}"
    if info.damaged:
        return f"{info.describe()}  DAMAGED: {info.problem}"
    if info.key is None:
        return f"{info.describe()}  unreadable: {info.problem}"
    return f"{info.describe()}  {_key_fields(info)}"


def _key_fields(info: CacheInfo) -> str:
    assert info.key is not None
    reference = (info.key.reference or "?")[:12]
    return (f"reference {reference}  data {info.key.data[:12]}  dtype {info.key.dtype}  "
            f"{info.n_datums:,} datums, {info.n_values:,} tokens")


def _not_ours(info: CacheInfo) -> str:
    """Why an entry is not a cache of ours: what it is."""
    link = f"it is a symbolic link (to {info.link!r})" if info.link is not None else ""
    return "; ".join(part for part in (link, info.problem) if part) or "it was not written by this package"


def _at_least_zero(cast: type, what: str) -> Callable[[str], float]:
    """An argparse ``type``: ``cast(text)``, rejected (naming ``what`` and the text) unless 0 or more."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            value = -1
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be {what}, 0 or more, got {text!r}")
        return value

    return parse


class _OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusal is one line on stderr (exit 2), as ``loops-callbacks fit``'s is, not the
    usage and then the error; ``--help`` still shows the usage."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)  # --keep is not --keep-newest: a prune says exactly what it is

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (0: done, 1: an entry to prune was left, and why is said,
    2: bad arguments)."""
    parser = _OneLineParser(
        prog=CACHE_TOOL,
        description="See and prune the reference-logprob caches of a directory (one file per reference weights, "
        "data and scoring dtype; a DPO run's cache_dir, by default <default_root_dir>/reference_logprobs).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every cache in DIR: size, date, key (and what else is named *.cache)").add_argument("directory", metavar="DIR")
    prune = commands.add_parser("prune", help="remove the caches of DIR that the options select (files this package "
                                "wrote, told by their header: nothing else is ever removed)")
    prune.add_argument("directory", metavar="DIR")
    prune.add_argument("--older-than", type=_at_least_zero(float, "a number of days"), metavar="DAYS",
                       help="remove those not modified for DAYS days")
    prune.add_argument("--keep-newest", type=_at_least_zero(int, "a whole number"), metavar="N",
                       help="remove all but the N newest")
    prune.add_argument(
        "--damaged",
        action="store_true",
        help="remove caches whose header is cut short or of an earlier version, or whose size is wrong, and "
        "temporary files of killed writers",
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        parser.error(f"{args.directory} {'is not a directory' if os.path.exists(args.directory) else 'does not exist'}")
    try:
        entries = list_caches(args.directory)
    except OSError as error:
        parser.error(f"{args.directory} cannot be read ({error.strerror or error})")
    temporaries = _temporaries(args.directory)
    caches, others = [info for info in entries if info.ours], [info for info in entries if not info.ours]
    if args.command == "list":
        if not any(info.ours or info.key for info in entries):
            print(f"no reference-logprob caches in {args.directory}")
        for info in entries:
            print(_line(info))
        if temporaries:
            print(f"{_killed_writers(temporaries)}: prune --damaged removes them")
        return 0
    if args.older_than is None and args.keep_newest is None and not args.damaged:
        parser.error("prune needs --older-than DAYS, --keep-newest N or --damaged (nothing is removed by default)")
    chosen = select_for_pruning(caches, older_than_days=args.older_than, keep_newest=args.keep_newest,
                                damaged=args.damaged)
    verb = "would remove" if args.dry_run else "removed"
    targets = chosen + (temporaries if args.damaged else [])
    outcome = {info.path: "" if args.dry_run else _remove(info) for info in targets}  # "": removed
    left = {path: why for path, why in outcome.items() if why and why != _GONE}
    removed = [info for info in chosen if not outcome[info.path]]
    for info in removed:
        print(f"{verb} {_line(info)}")
    freed = sum(info.size for info in removed) / (1 << 20)
    print(f"{len(removed)} of {len(caches)} caches {'selected' if args.dry_run else 'removed'} ({freed:.1f} MB)")
    if args.damaged and temporaries:
        print(f"{verb} {_killed_writers([info for info in temporaries if not outcome[info.path]])}")
    for path, why in outcome.items():
        if why == _GONE:
            print(f"{os.path.basename(path)} was gone already (removed meanwhile by something else)")
    for info in others:
        print(f"not ours, left alone: {info.describe()}: {_not_ours(info)}")
    for path, why in left.items():
        print(f"left {os.path.basename(path)}: {why}")
    return 1 if left else 0


def _temporaries(directory: str) -> list[CacheInfo]:
    """The temporary files of killed writers of this host (``orphaned_temporaries``) that this package wrote: a file
    (not a link, not a directory) that begins with a header of its format. Anything else of such a name is another
    program's and is left alone.
    """
    found = []
    for path in orphaned_temporaries(directory):
        try:
            entry = os.lstat(path)
            if not stat.S_ISREG(entry.st_mode):
                continue
            info = read_stored(path, values=False)
        except OSError:
            continue  # gone meanwhile, or cannot be read: it cannot be told to be ours
        if info.identity is not None and info.identity[:2] == (entry.st_dev, entry.st_ino) and info.ours:
            found.append(CacheInfo(path, info.size, info.modified, None, problem="the temporary file of a killed "
                                   "writer", ours=True, identity=info.identity))
    return found


def _killed_writers(temporaries: list[CacheInfo]) -> str:
    """``N temporary file(s) of killed writers (X MB)``."""
    return (f"{len(temporaries)} temporary file(s) of killed writers "
            f"({sum(info.size for info in temporaries) / (1 << 20):.1f} MB)")


_GONE = "gone"  # _remove's answer for a file that was removed meanwhile (told apart by identity)


def _remove(info: CacheInfo) -> str:
    """Remove the file ``info`` lists when it is still that file (never a link, never a directory): ``""`` when
    removed, ``_GONE`` when it was gone already, else why it stays.

    A file is the one listed while its device, inode, size and modification time are those read; a
    writer's ``os.replace`` since (a run that wrote its cache anew) makes another file, which stays.
    """
    try:
        status = os.lstat(info.path)
    except FileNotFoundError:
        return _GONE
    except OSError as error:
        return f"it cannot be checked ({error.strerror or error})"
    now = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
    if not stat.S_ISREG(status.st_mode) or info.identity is None or now != info.identity:
        return "it changed since it was listed (another file is under its name now): not removed"
    try:
        os.remove(info.path)
    except FileNotFoundError:
        return _GONE
    except OSError as error:
        return f"it cannot be removed ({error.strerror or error})"
    return ""
