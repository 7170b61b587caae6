"""The on-disk cache of reference logprobs: one safetensors file per key, written atomically, read whole and checked.

A cache file is a standard safetensors file (``safetensors.numpy.load_file`` opens it) of two
tensors, ``values`` (float32: every datum's ``ref_logprobs`` back to back) and ``lengths`` (int64:
one per datum), whose metadata hold the key the values were computed for (``reference``: the
reference weights' fingerprint, ``data``: the token data's, ``dtype``: the scoring dtype), the
format and ``sha256``, the checksum of the two tensors' bytes. Each key has its own file beside the
cache's base path (``cache_file``: ``ref_logprobs.<16 hex digits of the key>.cache``), so runs that
share a directory never replace each other's values. ``read_cache`` returns the values only when the
file is whole, its checksum right, its key the one asked for and its lengths the data's; otherwise
it says why, and the caller scores again. ``find_cache`` is the run's lookup: this key's file, else
any whole match in the directory (``list_caches``: every cache there, from its header). A file of an
earlier version (the ``LOOPSREF`` format) is named as such.

safetensors reads the file (``safe_open`` with its ``pread`` backend) into this process's memory
once, and it is checked there: a file copied over, truncated or removed while a job runs cannot
change that job's values, nor kill it with ``SIGBUS`` as a memory map of a truncated file does.
``loops-callbacks cache list|prune DIR`` (``loops_callbacks.reference.cache_tool``) shows and
removes caches.

Examples:
    >>> import os, tempfile
    >>> import numpy as np
    >>> key = CacheKey(reference="r", data=data_fingerprint([[1, 2], [3]]), dtype="float32")
    >>> base = os.path.join(tempfile.mkdtemp(), CACHE_FILE_NAME)
    >>> write_cache(cache_file(base, key), key, [np.array([-0.5, 0.0]), np.array([0.0])])
    >>> lookup = read_cache(cache_file(base, key), key, [2, 1])
    >>> lookup.status, lookup.flat.tolist(), lookup.flat.dtype
    ('hit', [-0.5, 0.0, 0.0], dtype('float32'))
    >>> miss = read_cache(cache_file(base, key), CacheKey("r", key.data, "bfloat16"), [2, 1])
    >>> miss.status, miss.reason
    ('stale', 'the scoring dtype changed')
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.validation import check_reference_logprobs

__all__ = ["CACHE_FILE_NAME", "CACHE_TOOL", "MAX_HEADER_BYTES", "CacheInfo", "CacheKey", "CacheLookup", "cache_file",
           "checksum", "data_fingerprint", "find_cache", "list_caches", "open_regular", "orphaned_temporaries",
           "read_cache", "read_stored", "write_cache", "written_by_this_package"]

CACHE_FILE_NAME = "ref_logprobs.cache"
"""The cache's base name in its directory; each key's file is ``cache_file(base, key)`` beside it."""
CACHE_TOOL = "loops-callbacks cache"
"""The command that lists (``list DIR``) and removes (``prune DIR ...``) caches."""
_FORMAT = "loops-callbacks reference logprobs 3"
_EARLIER_FORMAT = b"LOOPSREF"  # the first bytes of the files of earlier versions
MAX_HEADER_BYTES = 1 << 20  # a real header is a few hundred bytes
_FORMAT_MARK = json.dumps(_FORMAT).encode()  # in the header of every file of this format, as the format's value
_KEY_NAMES = {"reference": "the reference weights", "data": "the data", "dtype": "the scoring dtype"}
_HOST = socket.gethostname().replace(os.sep, "_") or "host"  # in temporary file names: pids are per host


@dataclass(frozen=True)
class CacheKey:
    """What the cached values depend on; a file made for another key is never used.

    ``reference``: the reference weights' fingerprint; ``data``: the token data's
    (``data_fingerprint``); ``dtype``: the *cache tag*, what else the values depend on: the scoring
    dtype, ``"model"`` (the model's own dtype) or, for the policy scored in place,
    ``"policy|precision=<the trainer's precision>"`` (``policy_tag``). ``reference=None`` asks for a
    file of these data and dtype whatever reference made it (a resumed run that cannot know its
    initial weights' fingerprint).
    """

    reference: str | None
    data: str
    dtype: str

    def differences(self, other: CacheKey) -> list[str]:
        """What ``other`` (a stored key) was made with that this key does not ask for, in words.

        Examples:
            >>> CacheKey("a", "d", "float32").differences(CacheKey("b", "d", "bfloat16"))
            ['the reference weights', 'the scoring dtype']
        """
        return [words for name, words in _KEY_NAMES.items()
                if getattr(self, name) is not None and getattr(other, name) != getattr(self, name)]


@dataclass
class CacheLookup:
    """The outcome of ``read_cache`` / ``find_cache``: ``flat`` (the values, in this process's memory) when
    ``status == "hit"``, else why not.

    ``status`` is ``"hit"``, ``"missing"`` (no file, and no other cache beside it), ``"stale"``
    (files made for other keys only: ``reason`` names them and what differs), ``"corrupt"`` (a
    damaged file, one of an earlier version, one whose lengths do not fit the data, or one holding
    values that are not logprobs) or ``"off"`` (a run without a cache). ``path`` is the file the
    values were read from, or the file this key's values belong in; ``digest`` the checksum of what was read.
    """

    status: Literal["hit", "missing", "stale", "corrupt", "off"]
    reason: str = ""
    flat: np.ndarray | None = None
    digest: str | None = None
    key: CacheKey | None = None
    path: str | None = None


def data_fingerprint(token_lists: Sequence[Sequence[int]] | PackedTokens) -> str:
    """sha256 of the datums' token ids and their order (and of where each datum starts and ends).

    Examples:
        >>> data_fingerprint([[1, 2], [3]]) == data_fingerprint([[1], [2, 3]])
        False
    """
    packed = token_lists if isinstance(token_lists, PackedTokens) else PackedTokens.from_sequences(token_lists)
    digest = hashlib.sha256(b"loops-callbacks token data v1\n")
    digest.update(packed.lengths.astype("<i8", copy=False).tobytes())
    digest.update(packed.ids.astype("<i8", copy=False).tobytes())
    return digest.hexdigest()


def cache_file(base: str | os.PathLike[str], key: CacheKey) -> str:
    """The file of ``key``'s values: ``base`` with 16 hex digits of the key's sha256 before its suffix.

    Examples:
        >>> cache_file("/c/ref_logprobs.cache", CacheKey("r", "d", "float32"))
        '/c/ref_logprobs.d248f4ef7b6b7925.cache'
    """
    if key.reference is None:
        raise ValueError("cache_file needs the reference's fingerprint in the key (got reference=None)")
    stem, suffix = os.path.splitext(os.fspath(base))
    name = hashlib.sha256(json.dumps(dataclasses.asdict(key), sort_keys=True).encode()).hexdigest()[:16]
    return f"{stem}.{name}{suffix}"


def checksum(lengths: np.ndarray, values: np.ndarray) -> str:
    """sha256 of the lengths' bytes, then the values' (the file's ``sha256`` metadata)."""
    digest = hashlib.sha256(memoryview(np.ascontiguousarray(lengths)))
    digest.update(memoryview(np.ascontiguousarray(values)))
    return digest.hexdigest()


def write_cache(path: str | os.PathLike[str], key: CacheKey, values: Sequence[np.ndarray] | np.ndarray,
                lengths: Sequence[int] | np.ndarray | None = None) -> None:
    """Write ``values`` for ``key`` to ``path``: a temporary file made exclusively, then ``os.replace``.

    ``values`` is one 1-D array per datum, or one flat float32 array with the datums' ``lengths``; a value that is
    not a logprob (NaN, infinite, above 0 beyond rounding) is a ``ValueError`` naming the datum and position, and
    nothing is written.
    A reader sees the old file or the new one, never a partial one. The temporary file
    ``<path>.tmp.<host>.<pid>`` is created with ``O_EXCL | O_NOFOLLOW``: a file or link already
    there is never written through (a ``FileExistsError``). Creates the directory, and removes the
    temporary files of earlier writers of this cache that were killed before their ``os.replace``.
    """
    from safetensors.numpy import save

    path = os.fspath(path)
    if key.reference is None:
        raise ValueError("write_cache needs the reference's fingerprint in its key (got reference=None)")
    if lengths is None:
        lengths = [len(v) for v in values]
        values = np.concatenate([np.asarray(v).reshape(-1) for v in values]) if len(values) else np.zeros(0)
    sizes, flat = np.asarray(lengths, dtype="<i8"), np.ascontiguousarray(values, dtype="<f4").reshape(-1)
    if int(sizes.sum()) != flat.size:
        raise ValueError(f"write_cache: the lengths add up to {int(sizes.sum())} values, the array holds {flat.size}")
    check_reference_logprobs(flat, where="write_cache: the values to cache", lengths=sizes)  # nothing written
    metadata = {"format": _FORMAT, **dataclasses.asdict(key), "sha256": checksum(sizes, flat)}
    blob = save({"values": flat, "lengths": sizes}, metadata=metadata)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for orphan in orphaned_temporaries(os.path.dirname(path) or ".", os.path.basename(path)):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours: a leftover is no reason to fail a write
            os.remove(orphan)
    temporary = f"{path}.tmp.{_HOST}.{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(temporary, flags, 0o644)
    except FileExistsError as error:
        raise FileExistsError(errno.EEXIST, "write_cache: its temporary file already exists (not made by this "
                              "write); not writing through it", temporary) from error
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(blob)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)  # ours: created exclusively above
        raise


def orphaned_temporaries(directory: str | os.PathLike[str], cache_name: str | None = None) -> list[str]:
    """The temporary files in ``directory`` whose writer, on this host, no longer runs.

    They are named ``<cache>.tmp.<host>.<pid>`` (``<cache>.tmp.<pid>`` before the host was part of
    the name); ``cache_name`` limits them to one cache's, else any ``*.cache``'s. A live process's,
    or another host's (a shared file system: its pid means nothing here), are not orphans.

    Examples:
        >>> import tempfile
        >>> orphaned_temporaries(tempfile.mkdtemp())
        []
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    orphans = []
    for name in names:
        cache, separator, rest = name.partition(".tmp.")
        if not separator or (cache != cache_name if cache_name is not None else not cache.endswith(".cache")):
            continue
        host, _, pid = rest.rpartition(".")
        if host in (_HOST, "") and pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            orphans.append(os.path.join(directory, name))
    return sorted(orphans)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (when that cannot be told: assume it does)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only checked
    except ProcessLookupError:
        return False
    except OSError:  # it exists, but belongs to another user
        return True
    return True


def read_cache(path: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray, *,
               digest: str | None = None) -> CacheLookup:
    """The cached values for ``key`` when ``path`` holds a whole file for it with these ``lengths``.

    safetensors reads the file into memory once (``read_stored``) and the checksum is computed over
    exactly the arrays read, so the values cannot change afterwards, whatever happens to the file.
    With ``digest`` (the checksum another rank found), the values read here must also have that checksum.
    """
    path = os.fspath(path)
    try:
        stored = read_stored(path)
    except FileNotFoundError:
        return CacheLookup("missing", path=path)
    except OSError as error:
        return CacheLookup("corrupt", reason=f"it cannot be read ({error})", path=path)
    except MemoryError:
        return CacheLookup("corrupt", reason="it does not fit in this process's memory", path=path)
    lookup = CacheLookup("corrupt", reason=stored.problem) if stored.problem else _check(stored, key, lengths, digest)
    lookup.path = path
    return lookup


_TENSORS = {"values": "F32", "lengths": "I64"}  # safetensors' dtype names


def read_stored(path: str, *, values: bool = True) -> CacheInfo:
    """What the file ``path`` holds as safetensors reads it: its key, checksum and sizes (and, with ``values``, its
    tensors), or why it is no whole cache of this version (``problem``); and whether this package wrote it.

    safetensors reads it with its ``pread`` backend: into this process's memory, not mapped, so a file truncated
    meanwhile is an error, never a ``SIGBUS``. ``OSError`` when it cannot be opened or is no regular file (never
    waits on a FIFO).
    """
    from safetensors import SafetensorError, safe_open

    descriptor, size = open_regular(path)
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        opened = os.fstat(descriptor)
        head = file.read(8)
        head += file.read(min(int.from_bytes(head, "little"), MAX_HEADER_BYTES)) if len(head) == 8 else b""
    ours = written_by_this_package(head)
    info = CacheInfo(path, size, opened.st_mtime, None, ours=ours,
                     identity=(opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns))
    try:
        with safe_open(path, "np", backend="pread") as reader:
            metadata = reader.metadata() or {}
            if metadata.get("format") != _FORMAT:
                return dataclasses.replace(info, problem="it is not a reference-logprob cache (no "
                                           f"{_FORMAT!r} in its metadata)")
            shapes = {name: (reader.get_slice(name).get_dtype(), reader.get_slice(name).get_shape())
                      for name in _TENSORS if name in reader.keys()}
            if any(shapes.get(name, ("", ()))[0] != dtype or len(shapes[name][1]) != 1
                   for name, dtype in _TENSORS.items()) or not all(name in metadata for name in _KEY_NAMES):
                return dataclasses.replace(info, damaged=True, problem="its header is damaged (not one-dimensional "
                                           f"values F32 and lengths I64 with a key: {shapes}, {metadata})")
            tensors = {name: reader.get_tensor(name) for name in _TENSORS} if values else {}
    except SafetensorError as error:
        problem, damaged = _why_unreadable(head, size, error)
        return dataclasses.replace(info, problem=problem, damaged=damaged)
    (n_values,), (n_datums,) = shapes["values"][1], shapes["lengths"][1]
    return dataclasses.replace(info, key=CacheKey(*(metadata[name] for name in _KEY_NAMES)), n_datums=n_datums,
                               n_values=n_values, checksum=metadata.get("sha256"), **tensors)


def written_by_this_package(head: bytes) -> bool:
    """Whether a file whose first bytes are ``head`` was written by this package, whole or not: a safetensors header
    that names this package's format (even cut short after it), or a cache of an earlier version (``LOOPSREF``).

    No other program's file is: a file without such a header is never taken for a cache, whatever its name.

    Examples:
        >>> written_by_this_package(b"LOOPSREF" + bytes(8)), written_by_this_package(b"some notes")
        (True, False)
    """
    if head.startswith(_EARLIER_FORMAT):
        return True
    size = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    return size > 0 and head[8:9] == b"{" and _FORMAT_MARK in head[8 : 8 + min(size, MAX_HEADER_BYTES)]


def _why_unreadable(head: bytes, file_size: int, error: Exception) -> tuple[str, bool]:
    """Why safetensors could not read a file whose first bytes are ``head`` (told from them, ``error`` shown), and
    whether it is a damaged cache of ours: a whole header of this format, contents that do not fit it."""
    if head.startswith(_EARLIER_FORMAT):
        return ("it is a cache of an earlier version of loops-callbacks (the LOOPSREF format), which this version "
                "does not read; it is scored again into a safetensors file"), False
    if not written_by_this_package(head):
        return "it is not a reference-logprob cache (no header of this package's format)", False
    size = int.from_bytes(head[:8], "little")
    if 8 + size > file_size:
        return (f"its header is cut short or damaged: a header of {size} bytes does not fit in its {file_size} "
                "bytes"), False
    return f"its header is damaged or the file is truncated (safetensors: {error})", True


def _check(stored: CacheInfo, key: CacheKey, lengths: Sequence[int] | np.ndarray,
           expected_digest: str | None) -> CacheLookup:
    """``stored`` as the values of ``key`` for data of these ``lengths``, or why it is not."""
    stored_lengths, flat = stored.lengths, stored.values
    assert stored_lengths is not None and flat is not None and stored.key is not None  # a whole file, read whole
    digest = checksum(stored_lengths, flat)
    if digest != stored.checksum:
        return CacheLookup("corrupt", reason="its checksum does not match its contents")
    if expected_digest is not None and digest != expected_digest:
        return CacheLookup("corrupt", reason="it is not the file the first rank checked (another checksum)")
    changed = key.differences(stored.key)
    if changed:
        return CacheLookup("stale", reason=" and ".join(changed) + " changed", key=stored.key)
    if not np.array_equal(stored_lengths, np.asarray(lengths, dtype=np.int64)):
        return CacheLookup("corrupt", reason="its datum lengths do not match the data")
    if int(stored_lengths.sum()) != len(flat):
        return CacheLookup("corrupt", reason="its lengths do not add up to its number of values")
    try:  # written unchecked (by an earlier version): never handed out
        check_reference_logprobs(flat, where="its values", lengths=stored_lengths)
    except ValueError as error:
        return CacheLookup("corrupt", reason=f"it holds values that are not logprobs ({error})")
    return CacheLookup("hit", flat=flat, digest=digest, key=stored.key)


_LISTED = 8  # caches named in a message about a miss (the rest are counted)


@dataclass(frozen=True)
class CacheInfo:
    """One entry of a cache directory (``list_caches``: from its header only), or a cache file read whole
    (``read_stored``: ``lengths`` and ``values`` too); ``key`` is ``None`` (and ``problem`` says why) for a file
    that is no whole cache of this version.

    ``ours``: a file this package wrote (a header of its format, whole or not), not reached through a
    link; ``prune`` selects nothing else. ``damaged``: one of ours whose header is whole but whose contents do
    not fit it. ``link``: where a symbolic link leads (it is read through, never removed). ``identity``:
    ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file read; one that no longer has it when its turn
    comes is not removed. ``checksum``: the ``sha256`` its metadata hold.
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
    damaged: bool = False
    checksum: str | None = None
    lengths: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    values: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

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
        info = read_stored(path, values=False)  # through a link: a run may read a linked cache
    except FileNotFoundError as error:
        return _unreadable(path, error) if named and os.path.lexists(path) else None  # a broken link, or gone
    except OSError as error:
        return _unreadable(path, error) if named else None
    ours = info.ours and link is None
    return None if info.problem and not (named or ours) else dataclasses.replace(info, ours=ours, link=link)


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


def open_regular(path: str) -> tuple[int, int]:
    """A read-only descriptor of ``path`` and its size; unless a regular file, ``OSError`` (``EINVAL``: what it is
    instead). Never waits on a FIFO."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "a directory, not a cache file" if stat.S_ISDIR(status.st_mode)
                      else "not a regular file (a FIFO, socket or device)", path)
    return descriptor, status.st_size

