"""The reference-logprob caches of a directory: which one a run reads (``find_cache``), and the command that lists
and prunes them, ``loops-callbacks cache`` (``python -m loops_callbacks cache`` is the same)::

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
    >>> from loops_callbacks.reference.cache import CACHE_FILE_NAME, data_fingerprint, write_cache
    >>> key = CacheKey(reference="r", data=data_fingerprint([[1, 2], [3]]), dtype="float32")
    >>> base = os.path.join(tempfile.mkdtemp(), CACHE_FILE_NAME)
    >>> write_cache(cache_file(base, key), key, [np.array([-0.5, 0.0]), np.array([0.0])])
    >>> lookup = find_cache(base, key, [2, 1])
    >>> lookup.status, lookup.flat.tolist(), find_cache(base, CacheKey("other", key.data, "float32"), [2, 1]).status
    ('hit', [-0.5, 0.0, 0.0], 'stale')
    >>> main(["list", os.path.dirname(base)])  # doctest: +ELLIPSIS
    ref_logprobs....cache (0.0 MB, ...)  reference r  data ...  dtype float32  2 datums, 3 tokens
    0
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from loops_callbacks.reference.cache import (
    CACHE_TOOL,
    MAX_HEADER_BYTES,
    CacheKey,
    CacheLookup,
    cache_file,
    open_regular,
    orphaned_temporaries,
    read_cache,
    read_header,
    written_by_this_package,
)

__all__ = ["CacheInfo", "find_cache", "list_caches", "main", "select_for_pruning"]

_LISTED = 8  # caches named in a message about a miss (the rest are counted)


@dataclass(frozen=True)
class CacheInfo:
    """One entry of a cache directory, from its header only (``list_caches``); ``key`` is ``None`` (and
    ``problem`` says why) for a file whose header cannot be read.

    ``ours``: a file this package wrote (a header of its format, whole or not), not reached through a
    link; ``prune`` selects nothing else. ``link``: where a symbolic link leads (it is read through,
    never removed). ``identity``: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file read; one that
    no longer has it when its turn comes is not removed.
    """

    path: str
    size: int
    modified: float
    key: CacheKey | None
    n_datums: int | None = None
    n_values: int | None = None
    problem: str = ""
    ours: bool = False
    link: str | None = None
    identity: tuple[int, int, int, int] | None = None

    def describe(self) -> str:
        """``name (size, date)``, as messages and ``cache_tool list`` show it.

        Examples:
            >>> CacheInfo("/c/ref_logprobs.cache", 3 << 20, 0.0, None).describe()
            'ref_logprobs.cache (3.0 MB, 1970-01-01 00:00 UTC)'
        """
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.modified))
        return f"{os.path.basename(self.path)} ({self.size / (1 << 20):.1f} MB, {when})"


def find_cache(base: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray) -> CacheLookup:
    """The values for ``key`` from the cache directory of ``base``: its file (``cache_file``), else any whole match.

    Any other file of the directory whose metadata hold ``key`` is used when whole. With
    ``key.reference=None`` a whole file of these data and dtype is used, unless files of them by
    several references are there (which one is meant cannot be told: a miss). A miss names every
    cache in the directory and what differs (``reason``); ``path`` is then the file ``key``'s values belong in.
    """
    directory = os.path.dirname(os.fspath(base)) or "."
    path = None
    if key.reference is not None:
        path = cache_file(base, key)
        lookup = read_cache(path, key, lengths)
        if lookup.status == "stale":  # a whole file, but not the one its name says
            lookup = CacheLookup("corrupt", f"it is named for this key but was made for another ({lookup.reason})",
                                 path=path)
        if lookup.status != "missing":
            return lookup
    try:  # caches only: whatever else is in the directory is no reason to miss, and not named
        others = [info for info in list_caches(directory) if info.path != path and (info.ours or info.key)]
    except OSError as error:
        return CacheLookup("corrupt", f"its directory cannot be listed ({error})", path=path)
    candidates = [info for info in others if info.key is not None and not key.differences(info.key)]
    references = {info.key.reference for info in candidates if info.key is not None}
    if len(references) > 1:
        named = "; ".join(f"{info.describe()}: reference {str(info.key and info.key.reference)[:12]}"
                          for info in candidates)
        return CacheLookup("stale", f"{len(candidates)} caches in {directory} hold these data and dtype, made by "
                           f"{len(references)} references ({named}), and which one is meant is not known (no "
                           f"reference fingerprint was given); remove the ones not wanted (`{CACHE_TOOL} list "
                           f"{directory}`)")
    unusable: dict[str, str] = {}
    for info in candidates:
        found = read_cache(info.path, key, lengths)
        if found.status == "hit":
            return found
        unusable[info.path] = found.reason
    if not others:
        return CacheLookup("missing", path=path)
    return CacheLookup("stale", _why_none_matches(others, key, unusable, directory), path=path)


def list_caches(directory: str | os.PathLike[str]) -> list[CacheInfo]:
    """Every cache file in ``directory`` (told by its header, whatever its name) and every other entry named
    ``*.cache``, newest first, from their headers only.

    An entry is ``ours`` only when it is a file (not a link) whose header is of this package's format;
    another program's file, a directory, a link, a FIFO or a file that cannot be read is not, and
    ``problem`` says what it is. Temporary files of writers (``*.tmp.*``) are not caches. A directory
    that does not exist holds none; one that cannot be read is an ``OSError``.
    """
    try:
        entries = [entry.path for entry in os.scandir(directory) if ".tmp." not in entry.name]
    except FileNotFoundError:
        return []
    infos = [info for info in map(_info, entries) if info is not None]
    return sorted(infos, key=lambda info: (-info.modified, info.path))


def _why_none_matches(others: list[CacheInfo], key: CacheKey, unusable: dict[str, str], directory: str) -> str:
    """``reason`` of a miss: each cache of the directory (the closest first) and why it is not this run's."""

    def why(info: CacheInfo) -> str:
        if info.key is None:
            return f"unreadable: {info.problem}"
        changed = key.differences(info.key)
        return " and ".join(changed) + " changed" if changed else f"damaged: {unusable.get(info.path, info.problem)}"

    closest = sorted(others, key=lambda info: (len(key.differences(info.key)) if info.key else 4, -info.modified))
    named = [f"{info.describe()}: {why(info)}" for info in closest[:_LISTED]]
    more = f"; and {len(others) - _LISTED} more" if len(others) > _LISTED else ""
    return (f"none of the {len(others)} cache(s) in {directory} holds these values ({'; '.join(named)}{more}); "
            f"see or prune them with `{CACHE_TOOL} list {directory}`")


def _info(path: str) -> CacheInfo | None:
    """What ``path``'s header says (``None``: neither a cache nor named ``*.cache``, or gone meanwhile)."""
    name = os.path.basename(path)
    named = name.endswith(".cache") and not name.startswith(".")  # not hidden: ~/.cache in a cache_dir set to ~
    try:
        entry = os.lstat(path)
        link = os.readlink(path) if stat.S_ISLNK(entry.st_mode) else None
        descriptor, size = open_regular(path)  # through a link: a run may read a linked cache
        with os.fdopen(descriptor, "rb", buffering=0) as file:
            opened = os.fstat(file.fileno())
            head = file.read(8 + MAX_HEADER_BYTES)
    except FileNotFoundError as error:
        return _unreadable(path, error) if named and os.path.lexists(path) else None  # a broken link, or gone
    except OSError as error:
        return _unreadable(path, error) if named else None
    identity = (opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns)
    ours = link is None and written_by_this_package(head)
    header = read_header(head, size)
    if isinstance(header, str):
        if not (named or ours):
            return None
        return CacheInfo(path, size, opened.st_mtime, None, problem=header, ours=ours, link=link, identity=identity)
    problem = "" if header.file_size == size else f"truncated or damaged: {size} bytes, its header promises more"
    counts = (header.tensors["lengths"][0], header.tensors["values"][0])
    return CacheInfo(path, size, opened.st_mtime, header.key, *counts, problem=problem, ours=ours, link=link,
                     identity=identity)


def _unreadable(path: str, error: OSError) -> CacheInfo | None:
    """A ``CacheInfo`` (not ours) for an entry that cannot be opened as a file, saying what it is (never following a
    link).

    Examples:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> try:
        ...     open_regular(directory)
        ... except OSError as error:
        ...     print(_unreadable(directory, error).problem)
        it is a directory, not a cache file
    """
    try:
        status = os.lstat(path)
        link = os.readlink(path) if stat.S_ISLNK(status.st_mode) else None
    except OSError:
        return None  # gone meanwhile
    if link is not None and not os.path.exists(path):
        problem, link = f"it is a broken symbolic link (to {link!r})", None
    elif error.errno == errno.EINVAL:  # open_regular: it is no regular file, and says what it is
        problem = f"it is {error.strerror}"
    else:
        problem = f"it cannot be read ({error.strerror or error}), so it cannot be told to be a cache"
    return CacheInfo(path, status.st_size, status.st_mtime, None, problem=problem, link=link)


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
    if info.key is None:
        return f"{info.describe()}  unreadable: {info.problem}"
    return f"{info.describe()}  {_key_fields(info)}{'  DAMAGED: ' + info.problem if info.problem else ''}"


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
            descriptor, _ = open_regular(path)
            with os.fdopen(descriptor, "rb", buffering=0) as file:
                opened = os.fstat(file.fileno())
                head = file.read(8 + MAX_HEADER_BYTES)
        except OSError:
            continue  # gone meanwhile, or cannot be read: it cannot be told to be ours
        if (opened.st_dev, opened.st_ino) == (entry.st_dev, entry.st_ino) and written_by_this_package(head):
            identity = (opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns)
            found.append(CacheInfo(path, opened.st_size, opened.st_mtime, None, problem="the temporary file of a "
                                   "killed writer", ours=True, identity=identity))
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
