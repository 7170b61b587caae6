"""The on-disk cache of reference logprobs: keys, one file per key, an atomic writer and a reader that trusts nothing.

A cache file holds the ``ref_logprobs`` of every datum of one data set under one reference, and
the key they were computed for: a fingerprint of the reference weights, a fingerprint of the
token data (every datum's ``model_input`` tokens, in order) and the scoring dtype.

File layout (little-endian)::

    b"LOOPSREF"  uint32 header size  header (UTF-8 JSON, space-padded)  int64 lengths[N]  float32 values[M]  sha256[32]

The trailing sha256 covers every byte before it. Each key has its own file beside the cache's
base path (``cache_file``: ``ref_logprobs.<16 hex digits of the key>.cache``), so runs that share
a directory never replace each other's values; a file at the base path itself (the single-file
layout of earlier versions) is still read when its key matches. ``find_cache`` and
``read_cache`` return the values only when the file is whole (size, checksum), its key equals
the one asked for, and its lengths equal the data's; otherwise they say why (naming the caches
the directory holds), and the caller scores again. Values are float32, as scored (and as the
SDK's ``ref_logprobs`` are), so a cached result is bit-for-bit the one that was scored.

The file is read into this process's memory once, and the checksum is computed over exactly the
bytes read: a file copied over, truncated or removed while a job runs cannot change that job's
values (nor kill it with ``SIGBUS``, as a memory map of a truncated file does). The cost is 4
bytes a token in each process (no pages shared between the ranks of a machine).
``loops-callbacks cache list|prune DIR`` (``loops_callbacks.reference.cache_tool``) shows and removes caches.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> key = CacheKey(reference="r", data=data_fingerprint([[1, 2], [3]]), dtype="float32")
    >>> base = os.path.join(tempfile.mkdtemp(), CACHE_FILE_NAME)
    >>> write_cache(cache_file(base, key), key, [np.array([-0.5, 0.0]), np.array([0.0])])
    >>> lookup = find_cache(base, key, [2, 1])
    >>> lookup.status, [v.tolist() for v in lookup.values], lookup.flat.dtype
    ('hit', [[-0.5, 0.0], [0.0]], dtype('float32'))
    >>> miss = find_cache(base, CacheKey("other", key.data, "float32"), [2, 1])
    >>> miss.status, "the reference weights changed" in miss.reason
    ('stale', True)
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from loops_callbacks.reference.packing import PackedTokens

__all__ = [
    "CACHE_FILE_NAME",
    "CACHE_TOOL",
    "CacheInfo",
    "CacheKey",
    "CacheLookup",
    "cache_file",
    "data_fingerprint",
    "find_cache",
    "list_caches",
    "orphaned_temporaries",
    "read_cache",
    "write_cache",
]

CACHE_FILE_NAME = "ref_logprobs.cache"
"""The cache's base name in its directory (each key's file is ``cache_file(base, key)``; this very
name is the single-file layout of earlier versions, still read)."""
CACHE_TOOL = "loops-callbacks cache"
"""The command that lists (``list DIR``) and removes (``prune DIR ...``) caches."""
_MAGIC = b"LOOPSREF"
_PREFIX = len(_MAGIC) + 4
_VERSION = 2
_DIGEST_SIZE = 32
_MAX_HEADER = 1 << 20  # a real header is a few hundred bytes
_KEY_NAMES = {"reference": "the reference weights", "data": "the data", "dtype": "the scoring dtype"}
_HOST = socket.gethostname().replace(os.sep, "_") or "host"  # in temporary file names: pids are per host
_LISTED = 8  # caches named in a message about a miss (the rest are counted)


@dataclass(frozen=True)
class CacheKey:
    """What the cached values depend on; a file made for another key is never used.

    ``reference=None`` asks for a file of these data and dtype whatever reference made it (a
    resumed run that cannot know its initial weights' fingerprint).
    """

    reference: str | None
    data: str
    dtype: str

    def differences(self, other: CacheKey) -> list[str]:
        """What ``other`` (a stored key) was made with that this key does not ask for, in words.

        Example:
            >>> CacheKey("a", "d", "float32").differences(CacheKey("b", "d", "bfloat16"))
            ['the reference weights', 'the scoring dtype']
        """
        return [
            words
            for name, words in _KEY_NAMES.items()
            if getattr(self, name) is not None and getattr(other, name) != getattr(self, name)
        ]


@dataclass(frozen=True)
class CacheInfo:
    """One file of a cache directory, from its header only (``list_caches``).

    ``key`` is ``None`` (and ``problem`` says why) for a file whose header cannot be read.
    """

    path: str
    size: int
    modified: float
    key: CacheKey | None
    num_datums: int | None = None
    num_values: int | None = None
    problem: str = ""

    def describe(self) -> str:
        """``name (size, date)``, as messages and ``cache_tool list`` show it.

        Example:
            >>> CacheInfo("/c/ref_logprobs.cache", 3 << 20, 0.0, None).describe()
            'ref_logprobs.cache (3.0 MB, 1970-01-01 00:00 UTC)'
        """
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.modified))
        return f"{os.path.basename(self.path)} ({self.size / (1 << 20):.1f} MB, {when})"


@dataclass
class CacheLookup:
    """The outcome of ``read_cache`` / ``find_cache``: ``flat`` (and ``values``) when ``status == "hit"``, else why not.

    ``status`` is ``"hit"``, ``"missing"`` (no file, and no other cache beside it), ``"stale"``
    (files made for other keys only: ``reason`` names them and what differs) or
    ``"corrupt"`` (a truncated or damaged file, or one whose lengths do not fit the data).
    ``path`` is the file the values were read from, or the file this key's values belong in.
    ``flat`` is in this process's memory (a read-only snapshot: the file may change afterwards).
    """

    status: Literal["hit", "missing", "stale", "corrupt"]
    reason: str = ""
    flat: np.ndarray | None = None
    lengths: np.ndarray | None = None
    digest: bytes | None = None
    key: CacheKey | None = None
    path: str | None = None

    @property
    def values(self) -> list[np.ndarray] | None:
        """One view of ``flat`` per datum, made when asked for (a loaded cache is used flat)."""
        if self.flat is None or self.lengths is None:
            return None
        return list(np.split(self.flat, np.cumsum(self.lengths)[:-1])) if len(self.lengths) else []


def data_fingerprint(token_lists: Sequence[Sequence[int]] | PackedTokens) -> str:
    """sha256 of the datums' token ids and their order (and of where each datum starts and ends).

    ``token_lists`` is a list of id lists, or ``PackedTokens`` (the same digest, without Python work per token).

    Example:
        >>> data_fingerprint([[1, 2], [3]]) == data_fingerprint([[1], [2, 3]])
        False
    """
    packed = token_lists if isinstance(token_lists, PackedTokens) else PackedTokens.from_sequences(token_lists)
    lengths = packed.lengths.astype("<i8", copy=False)
    flat = packed.ids.astype("<i8", copy=False)
    digest = hashlib.sha256(b"loops-callbacks token data v1\n")
    digest.update(lengths.tobytes())
    digest.update(flat.tobytes())
    return digest.hexdigest()


def cache_file(base: str | os.PathLike[str], key: CacheKey) -> str:
    """The file of ``key``'s values: ``base`` with 16 hex digits of the key's sha256 before its suffix.

    Example:
        >>> cache_file("/c/ref_logprobs.cache", CacheKey("r", "d", "float32"))
        '/c/ref_logprobs.d248f4ef7b6b7925.cache'
    """
    if key.reference is None:
        raise ValueError("cache_file needs the reference's fingerprint in the key (got reference=None)")
    stem, suffix = os.path.splitext(os.fspath(base))
    name = hashlib.sha256(json.dumps(dataclasses.asdict(key), sort_keys=True).encode()).hexdigest()[:16]
    return f"{stem}.{name}{suffix}"


def write_cache(
    path: str | os.PathLike[str],
    key: CacheKey,
    values: Sequence[np.ndarray] | np.ndarray,
    lengths: Sequence[int] | np.ndarray | None = None,
) -> None:
    """Write ``values`` for ``key`` to ``path``: a temporary file made exclusively, then ``os.replace``.

    ``values`` is one 1-D array per datum, or one flat float32 array with the datums' ``lengths``.
    A reader sees the old file or the new one, never a partial one. The temporary file
    ``<path>.tmp.<host>.<pid>`` is created with ``O_EXCL | O_NOFOLLOW``: a file or link already
    there is never written through (a ``FileExistsError``). Creates the directory, and removes
    the temporary files of earlier writers of this cache that were killed before their ``os.replace``.
    """
    path = os.fspath(path)
    if key.reference is None:
        raise ValueError("write_cache needs the reference's fingerprint in its key (got reference=None)")
    if lengths is None:
        sizes = np.array([len(v) for v in values], dtype="<i8")
        parts = [np.asarray(v, dtype="<f4").reshape(-1) for v in values]
        flat = np.concatenate(parts) if parts else np.zeros(0, "<f4")
    else:
        sizes = np.asarray(lengths, dtype="<i8")
        flat = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
        if int(sizes.sum()) != flat.size:
            total = int(sizes.sum())
            raise ValueError(f"write_cache: the lengths add up to {total} values, the array holds {flat.size}")
    header = json.dumps(
        {"version": _VERSION, "key": dataclasses.asdict(key), "num_datums": len(sizes), "num_values": int(flat.size)},
        sort_keys=True,
    ).encode()
    header += b" " * (-(_PREFIX + len(header)) % 8)  # the values start 8-byte aligned
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    _remove_orphaned_temporaries(path)
    temporary = f"{path}.tmp.{_HOST}.{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(temporary, flags, 0o644)
    except FileExistsError as error:
        raise FileExistsError(
            errno.EEXIST,
            "write_cache: its temporary file already exists (not made by this write); not writing through it",
            temporary,
        ) from error
    replaced = False
    try:
        with os.fdopen(descriptor, "wb") as file:
            digest = hashlib.sha256()
            for part in (_MAGIC, struct.pack("<I", len(header)), header, memoryview(sizes), memoryview(flat)):
                digest.update(part)
                file.write(part)
            file.write(digest.digest())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        replaced = True
    finally:
        if not replaced:
            try:
                os.remove(temporary)  # ours: created exclusively above
            except OSError:
                pass


def _remove_orphaned_temporaries(path: str) -> None:
    """Delete ``<path>.tmp.<host>.<pid>`` files whose writer, on this host, no longer runs.

    A writer killed between writing its temporary file and ``os.replace`` leaves it behind (as
    large as the cache); the next write for the same cache removes it. Files of a live process,
    of another host (a shared file system), or that cannot be removed are left alone.
    """
    for orphan in orphaned_temporaries(os.path.dirname(path) or ".", os.path.basename(path)):
        try:
            os.remove(orphan)
        except OSError:
            pass  # gone meanwhile, or not ours to remove: a leftover is no reason to fail a write


def orphaned_temporaries(directory: str | os.PathLike[str], cache_name: str | None = None) -> list[str]:
    """The temporary files in ``directory`` whose writer, on this host, no longer runs.

    They are named ``<cache>.tmp.<host>.<pid>`` (``<cache>.tmp.<pid>`` before the host was part of
    the name); ``cache_name`` limits them to one cache's, else any ``*.cache``'s. A live process's,
    or another host's (a shared file system: its pid means nothing here), are not orphans.

    Example:
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
        if host not in (_HOST, "") or not pid.isdigit() or int(pid) == os.getpid() or _running(int(pid)):
            continue
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


def read_cache(
    path: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray, *, digest: bytes | None = None
) -> CacheLookup:
    """The cached values for ``key`` when ``path`` holds a whole file for it with these ``lengths``.

    The file is read into memory once and the checksum is computed over exactly the bytes read,
    so the values cannot change afterwards, whatever happens to the file. With ``digest`` (the
    checksum another rank found), the bytes read here must also have that checksum.
    """
    path = os.fspath(path)
    try:
        blob = _read_whole(path)
    except FileNotFoundError:
        return CacheLookup("missing", path=path)
    except OSError as error:
        return CacheLookup("corrupt", reason=f"it cannot be read ({error})", path=path)
    except MemoryError:
        return CacheLookup("corrupt", reason="it does not fit in this process's memory", path=path)
    lookup = _parse(blob, key, lengths, digest)
    lookup.path = path
    return lookup


def find_cache(base: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray) -> CacheLookup:
    """The values for ``key`` from the cache directory of ``base``: its file (``cache_file``), else any whole match.

    A file at ``base`` itself (the single-file layout of earlier versions), or any other file of
    the directory whose header holds ``key``, is used when whole. With ``key.reference=None`` a
    whole file of these data and dtype is used, unless files of them by several references are
    there (which one is meant cannot be told: a miss). A miss names every cache in the directory
    and what differs (``reason``); ``path`` is then the file ``key``'s values belong in.
    """
    base = os.fspath(base)
    directory = os.path.dirname(base) or "."
    path = None
    if key.reference is not None:
        path = cache_file(base, key)
        lookup = read_cache(path, key, lengths)
        if lookup.status == "stale":  # a whole file, but not the one its name says
            lookup = CacheLookup("corrupt", f"it is named for this key but was made for another ({lookup.reason})")
            lookup.path = path
        if lookup.status != "missing":
            return lookup
    try:
        others = [info for info in list_caches(directory) if info.path != path]
    except OSError as error:
        return CacheLookup("corrupt", f"its directory cannot be listed ({error})", path=path)
    candidates = [info for info in others if info.key is not None and not key.differences(info.key)]
    references = sorted({info.key.reference or "" for info in candidates if info.key is not None})
    if len(references) > 1:
        named = "; ".join(f"{info.describe()}: reference {(info.key.reference or '?')[:12]}" for info in candidates)
        return CacheLookup(
            "stale",
            f"{len(candidates)} caches in {directory} hold these data and dtype, made by {len(references)} "
            f"references ({named}), and which one is meant is not known (no reference fingerprint was given); "
            f"remove the ones not wanted (`{CACHE_TOOL} list {directory}`)",
        )
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
    """Every cache file in ``directory`` (told by its first bytes), newest first, from its header only.

    Temporary files of writers (``*.tmp.*``) are not caches. An entry named ``*.cache`` that cannot
    be read as a file (a broken link, a directory, a FIFO, no permission) is listed as damaged. A
    directory that does not exist holds none; one that cannot be read is an ``OSError``.
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

    def name(info: CacheInfo) -> str:
        legacy = os.path.basename(info.path) == CACHE_FILE_NAME
        return info.describe() + (" [the single-file layout of earlier versions]" if legacy else "")

    named = [f"{name(info)}: {why(info)}" for info in closest[:_LISTED]]
    more = f"; and {len(others) - _LISTED} more" if len(others) > _LISTED else ""
    return (
        f"none of the {len(others)} cache(s) in {directory} holds these values ({'; '.join(named)}{more}); "
        f"see or prune them with `{CACHE_TOOL} list {directory}`"
    )


@dataclass(frozen=True)
class _Header:
    key: CacheKey
    version: object
    size: int  # of the header, in bytes
    num_datums: int
    num_values: int

    @property
    def file_size(self) -> int:
        return _PREFIX + self.size + 8 * self.num_datums + 4 * self.num_values + _DIGEST_SIZE


def _header(head: bytes | np.ndarray, file_size: int) -> _Header | str:
    """The header of a file whose first bytes are ``head`` (and whose size is ``file_size``), or why it is damaged."""
    if len(head) < _PREFIX or bytes(head[: len(_MAGIC)]) != _MAGIC:
        return "it is not a reference-logprob cache file (bad magic bytes)"
    (size,) = struct.unpack("<I", bytes(head[len(_MAGIC) : _PREFIX]))
    if size > min(_MAX_HEADER, file_size - _PREFIX - _DIGEST_SIZE) or len(head) < _PREFIX + size:
        return f"it is truncated or damaged: a header of {size} bytes does not fit in its {file_size} bytes"
    try:
        fields = json.loads(bytes(head[_PREFIX : _PREFIX + size]).decode())
        num_datums, num_values = fields["num_datums"], fields["num_values"]
        key = CacheKey(**fields["key"])
        version = fields["version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"its header is damaged ({type(error).__name__}: {error})"
    counts = (num_datums, num_values)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return f"its header is damaged (num_datums={num_datums!r}, num_values={num_values!r} are not counts)"
    if not all(isinstance(part, str) for part in (key.reference, key.data, key.dtype)):
        return f"its header is damaged (its key {dataclasses.asdict(key)} is not three strings)"
    return _Header(key, version, size, num_datums, num_values)


def _parse(
    blob: np.ndarray, key: CacheKey, lengths: Sequence[int] | np.ndarray, expected_digest: bytes | None = None
) -> CacheLookup:
    header = _header(blob[: _PREFIX + _MAX_HEADER], len(blob))
    if isinstance(header, str):
        return CacheLookup("corrupt", reason=header)
    if header.version != _VERSION:
        return CacheLookup("stale", reason=f"it has format version {header.version!r}, not {_VERSION}", key=header.key)
    if len(blob) != header.file_size:
        return CacheLookup(
            "corrupt",
            reason=f"it is truncated or damaged: {len(blob)} bytes where its header promises {header.file_size}",
        )
    trailer = bytes(blob[-_DIGEST_SIZE:])
    digest = hashlib.sha256()
    step = 64 << 20
    for start in range(0, len(blob) - _DIGEST_SIZE, step):
        digest.update(memoryview(blob[start : min(start + step, len(blob) - _DIGEST_SIZE)]))
    if digest.digest() != trailer:
        return CacheLookup("corrupt", reason="its checksum does not match its contents")
    if expected_digest is not None and trailer != expected_digest:
        return CacheLookup("corrupt", reason="it is not the file the first rank checked (another checksum)")
    changed = key.differences(header.key)
    if changed:
        return CacheLookup("stale", reason=" and ".join(changed) + " changed", key=header.key)
    start = _PREFIX + header.size
    stored_lengths = np.frombuffer(blob, dtype="<i8", count=header.num_datums, offset=start)
    if header.num_datums != len(lengths) or not np.array_equal(stored_lengths, np.asarray(lengths, dtype=np.int64)):
        return CacheLookup("corrupt", reason="its datum lengths do not match the data")
    if int(stored_lengths.sum()) != header.num_values:
        return CacheLookup("corrupt", reason="its lengths do not add up to its number of values")
    values_start = start + 8 * header.num_datums
    flat = blob[values_start : values_start + 4 * header.num_values].view("<f4")
    if not flat.flags.aligned:  # a hand-made file without the header padding
        flat = flat.copy()
    return CacheLookup("hit", flat=flat, lengths=stored_lengths, digest=trailer, key=header.key)


def _open_regular(path: str) -> tuple[int, int]:
    """A read-only descriptor of ``path`` and its size; ``OSError`` unless a regular file (never waits on a FIFO)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return descriptor, status.st_size


def _read_whole(path: str) -> np.ndarray:
    """Every byte of the file, in this process's memory (``OSError`` if it changes size while being read)."""
    descriptor, size = _open_regular(path)
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        blob = np.empty(size, dtype=np.uint8)
        view, done = memoryview(blob), 0
        while done < size:
            count = file.readinto(view[done:])
            if not count:
                break
            done += count
        if done != size or file.read(1):
            raise OSError(errno.EIO, f"it changed while being read ({size} bytes when opened, {done} read)", path)
    return blob


def _info(path: str) -> CacheInfo | None:
    """What ``path``'s header says (``None``: not a cache file at all)."""
    try:
        descriptor, size = _open_regular(path)
        with os.fdopen(descriptor, "rb", buffering=0) as file:
            head = file.read(_PREFIX + _MAX_HEADER)
            modified = os.fstat(file.fileno()).st_mtime
    except OSError as error:
        return _unreadable(path, error) if _named_as_a_cache(path) else None
    if not head.startswith(_MAGIC):
        return None
    header = _header(head, size)
    if isinstance(header, str):
        return CacheInfo(path, size, modified, None, problem=header)
    problem = f"truncated or damaged: {size} bytes, its header promises {header.file_size}"
    problem = "" if header.file_size == size else problem
    return CacheInfo(path, size, modified, header.key, header.num_datums, header.num_values, problem)


def _named_as_a_cache(path: str) -> bool:
    """``*.cache``, not hidden: ``~/.cache`` in a cache directory set to ``~`` is no cache of ours."""
    name = os.path.basename(path)
    return name.endswith(".cache") and not name.startswith(".")


def _unreadable(path: str, error: OSError) -> CacheInfo | None:
    """A damaged ``CacheInfo`` for an entry that cannot be opened as a file, saying what it is (never following a link).

    Example:
        >>> import tempfile
        >>> _unreadable(tempfile.mkdtemp(), OSError(errno.EINVAL, "not a regular file")).problem
        'it is a directory, not a cache file'
    """
    try:
        status = os.lstat(path)
    except OSError:
        return None  # gone meanwhile
    if stat.S_ISLNK(status.st_mode) and not os.path.exists(path):
        problem = f"it is a broken symbolic link (to {os.readlink(path)!r})"
    elif os.path.isdir(path):
        problem = "it is a directory, not a cache file"
    elif not stat.S_ISREG(os.stat(path).st_mode):
        problem = "it is not a regular file (a FIFO, socket or device)"
    else:
        problem = f"it cannot be read ({error.strerror or error})"
    return CacheInfo(path, status.st_size, status.st_mtime, None, problem=problem)
