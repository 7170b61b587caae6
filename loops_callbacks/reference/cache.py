"""The on-disk cache of reference logprobs: one safetensors file per key, written atomically, read whole and checked.

A cache file is a standard safetensors file (``safetensors.numpy.load_file`` opens it) of two
tensors, ``values`` (float32: every datum's ``ref_logprobs`` back to back) and ``lengths`` (int64:
one per datum), whose metadata hold the key the values were computed for (``reference``: the
reference weights' fingerprint, ``data``: the token data's, ``dtype``: the scoring dtype), the
format and ``sha256``, the checksum of the two tensors' bytes. Each key has its own file beside the
cache's base path (``cache_file``: ``ref_logprobs.<16 hex digits of the key>.cache``), so runs that
share a directory never replace each other's values. ``read_cache`` returns the values only when the
file is whole, its checksum right, its key the one asked for and its lengths the data's; otherwise
it says why, and the caller scores again (``cache_tool.find_cache`` looks through the directory).
A file of an earlier version (the ``LOOPSREF`` format) is named as such.

The file is read into this process's memory once and checked there, the values being views of
those bytes: a file copied over, truncated or removed while a job runs cannot change that job's
values, nor kill it with ``SIGBUS`` as a memory map of a truncated file does (safetensors' own
readers map the file; its ``load(bytes)`` copies every tensor once more). ``loops-callbacks cache
list|prune DIR`` (``loops_callbacks.reference.cache_tool``) shows and removes caches.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from loops_callbacks.reference.packing import PackedTokens
from loops_callbacks.validation import check_reference_logprobs

__all__ = ["CACHE_FILE_NAME", "CACHE_TOOL", "MAX_HEADER_BYTES", "CacheKey", "CacheLookup", "cache_file", "checksum",
           "data_fingerprint", "open_regular", "orphaned_temporaries", "read_cache", "read_header", "write_cache",
           "written_by_this_package"]

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

    The file is read into memory once and the checksum computed over exactly the bytes read, so the
    values cannot change afterwards, whatever happens to the file. With ``digest`` (the checksum
    another rank found), the bytes read here must also have that checksum.
    """
    path = os.fspath(path)
    try:
        descriptor, size = open_regular(path)
        with os.fdopen(descriptor, "rb", buffering=0) as file:
            blob = np.fromfile(file, dtype=np.uint8, count=size)  # a copy, not a map: no SIGBUS if truncated
            if len(blob) != size or file.read(1):
                raise OSError(errno.EIO, f"it changed while being read ({size} bytes when opened, {len(blob)} read)",
                              path)
    except FileNotFoundError:
        return CacheLookup("missing", path=path)
    except OSError as error:
        return CacheLookup("corrupt", reason=f"it cannot be read ({error})", path=path)
    except MemoryError:
        return CacheLookup("corrupt", reason="it does not fit in this process's memory", path=path)
    lookup = _parse(blob, key, np.asarray(lengths, dtype=np.int64), digest)
    lookup.path = path
    return lookup


@dataclass(frozen=True)
class _Header:
    key: CacheKey
    checksum: Any
    tensors: dict[str, tuple[int, int, int]]  # name: (count, first byte, last byte + 1), from the file's start
    file_size: int  # where the last tensor ends


_TENSORS = {"values": ("F32", np.dtype("<f4")), "lengths": ("I64", np.dtype("<i8"))}


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


def read_header(head: bytes, file_size: int) -> _Header | str:
    """The header of a file whose first bytes are ``head`` (and whose size is ``file_size``), or why it is no cache."""
    if head.startswith(_EARLIER_FORMAT):
        return ("it is a cache of an earlier version of loops-callbacks (the LOOPSREF format), which this version "
                "does not read; it is scored again into a safetensors file")
    if not written_by_this_package(head):
        return "it is not a reference-logprob cache (no header of this package's format)"
    size = int.from_bytes(head[:8], "little")
    if not size <= min(MAX_HEADER_BYTES, file_size - 8) or len(head) < 8 + size:
        return f"its header is cut short or damaged: a header of {size} bytes does not fit in its {file_size} bytes"
    try:
        fields = json.loads(bytes(head[8 : 8 + size]))
        metadata = fields.pop("__metadata__", None) or {}
        if metadata.get("format") != _FORMAT:
            return f"it is not a reference-logprob cache (no {_FORMAT!r} in its metadata)"
        key = CacheKey(*(metadata[name] for name in _KEY_NAMES))
        tensors = {}
        for name, (dtype, numpy_dtype) in _TENSORS.items():
            entry = fields[name]
            (count,), (start, stop) = entry["shape"], entry["data_offsets"]
            counts = all(type(n) is int and n >= 0 for n in (count, start, stop))
            if entry["dtype"] != dtype or not counts or stop - start != count * numpy_dtype.itemsize:
                raise ValueError(f"tensor {name!r} is {entry}")
            tensors[name] = (count, 8 + size + start, 8 + size + stop)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"its header is damaged ({type(error).__name__}: {error})"
    if not all(isinstance(part, str) for part in (key.reference, key.data, key.dtype)):
        return f"its header is damaged (its key {dataclasses.asdict(key)} is not three strings)"
    return _Header(key, metadata.get("sha256"), tensors, max(stop for _, _, stop in tensors.values()))


def _parse(blob: np.ndarray, key: CacheKey, lengths: np.ndarray, expected_digest: str | None) -> CacheLookup:
    header = read_header(bytes(blob[: 8 + MAX_HEADER_BYTES]), len(blob))
    if isinstance(header, str):
        return CacheLookup("corrupt", reason=header)
    if len(blob) != header.file_size:
        return CacheLookup("corrupt", reason=f"it is truncated or damaged: {len(blob)} bytes where its header "
                           f"promises {header.file_size}")
    arrays = {name: np.require(blob[start:stop].view(_TENSORS[name][1]), requirements="A")  # aligned: a view
              for name, (_, start, stop) in header.tensors.items()}
    stored_lengths, flat = arrays["lengths"], arrays["values"]
    digest = checksum(stored_lengths, flat)
    if digest != header.checksum:
        return CacheLookup("corrupt", reason="its checksum does not match its contents")
    if expected_digest is not None and digest != expected_digest:
        return CacheLookup("corrupt", reason="it is not the file the first rank checked (another checksum)")
    changed = key.differences(header.key)
    if changed:
        return CacheLookup("stale", reason=" and ".join(changed) + " changed", key=header.key)
    if not np.array_equal(stored_lengths, lengths):
        return CacheLookup("corrupt", reason="its datum lengths do not match the data")
    if int(stored_lengths.sum()) != len(flat):
        return CacheLookup("corrupt", reason="its lengths do not add up to its number of values")
    try:  # written unchecked (by an earlier version): never handed out
        check_reference_logprobs(flat, where="its values", lengths=stored_lengths)
    except ValueError as error:
        return CacheLookup("corrupt", reason=f"it holds values that are not logprobs ({error})")
    return CacheLookup("hit", flat=flat, digest=digest, key=header.key)


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

