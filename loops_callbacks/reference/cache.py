"""The on-disk cache of reference logprobs: keys, an atomic writer and a reader that trusts nothing.

A cache file holds the ``ref_logprobs`` of every datum of one data set under one reference, and
the key they were computed for: a fingerprint of the reference weights, a fingerprint of the
token data (every datum's ``model_input`` tokens, in order) and the scoring dtype.

File layout (little-endian)::

    b"LOOPSREF"  uint32 header size  header (UTF-8 JSON, space-padded)  int64 lengths[N]  float32 values[M]  sha256[32]

The trailing sha256 covers every byte before it. ``read_cache`` returns the values only when the
file is whole (size, checksum), its key equals the one asked for, and its lengths equal the
data's; otherwise it says why, and the caller scores again. Values are float32, as scored (and
as the SDK's ``ref_logprobs`` are), so a cached result is bit-for-bit the one that was scored;
the header is padded so that they start on an 8-byte boundary. They are not read into memory:
``read_cache`` and ``map_cache`` return a copy-on-write memory map of the file, so processes on
one machine share its pages and a data set of any size costs each of them at most 4 bytes a
token (and only the pages it touches).

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> key = CacheKey(reference="r", data=data_fingerprint([[1, 2], [3]]), dtype="float32")
    >>> path = os.path.join(tempfile.mkdtemp(), CACHE_FILE_NAME)
    >>> write_cache(path, key, [np.array([-0.5, 0.0]), np.array([0.0])])
    >>> lookup = read_cache(path, key, [2, 1])
    >>> lookup.status, [v.tolist() for v in lookup.values], lookup.flat.dtype
    ('hit', [[-0.5, 0.0], [0.0]], dtype('float32'))
    >>> read_cache(path, CacheKey("other", key.data, "float32"), [2, 1]).reason
    'the reference weights changed'
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from loops_callbacks.reference.packing import PackedTokens

__all__ = ["CACHE_FILE_NAME", "CacheKey", "CacheLookup", "data_fingerprint", "map_cache", "read_cache", "write_cache"]

CACHE_FILE_NAME = "ref_logprobs.cache"
_MAGIC = b"LOOPSREF"
_VERSION = 2
_DIGEST_SIZE = 32
_KEY_NAMES = {"reference": "the reference weights", "data": "the data", "dtype": "the scoring dtype"}
_HOST = socket.gethostname().replace(os.sep, "_") or "host"  # in temporary file names: pids are per host


@dataclass(frozen=True)
class CacheKey:
    """What the cached values depend on; a file made for another key is never used.

    ``reference=None`` asks for a file of these data and dtype whatever reference made it (a
    resumed run that cannot know its initial weights' fingerprint).
    """

    reference: str | None
    data: str
    dtype: str


@dataclass
class CacheLookup:
    """The outcome of ``read_cache``: ``flat`` (and ``values``) when ``status == "hit"``, else why not (``reason``).

    ``status`` is ``"hit"``, ``"missing"`` (no file), ``"stale"`` (a whole file made for another
    key) or ``"corrupt"`` (a truncated or damaged file, or one whose lengths do not fit the data).
    """

    status: Literal["hit", "missing", "stale", "corrupt"]
    reason: str = ""
    flat: np.ndarray | None = None
    lengths: np.ndarray | None = None
    digest: bytes | None = None
    key: CacheKey | None = None

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


def write_cache(
    path: str | os.PathLike[str],
    key: CacheKey,
    values: Sequence[np.ndarray] | np.ndarray,
    lengths: Sequence[int] | np.ndarray | None = None,
) -> None:
    """Write ``values`` for ``key``: a temporary file, then ``os.replace``.

    ``values`` is one 1-D array per datum, or one flat float32 array with the datums' ``lengths``.
    A reader sees the old file or the new one, never a partial one. Creates the directory, and
    removes the temporary files of earlier writers of this cache that were killed before their
    ``os.replace``.
    """
    path = os.fspath(path)
    if key.reference is None:
        raise ValueError("write_cache needs the reference's fingerprint in its key (got reference=None)")
    if lengths is None:
        sizes = np.array([len(v) for v in values], dtype="<i8")
        flat = (
            np.concatenate([np.asarray(v, dtype="<f4").reshape(-1) for v in values]) if len(values) else np.zeros(0, "<f4")
        )
    else:
        sizes = np.asarray(lengths, dtype="<i8")
        flat = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
        if int(sizes.sum()) != flat.size:
            raise ValueError(f"write_cache: the lengths add up to {int(sizes.sum())} values, the array holds {flat.size}")
    header = json.dumps(
        {"version": _VERSION, "key": dataclasses.asdict(key), "num_datums": len(sizes), "num_values": int(flat.size)},
        sort_keys=True,
    ).encode()
    header += b" " * (-(len(_MAGIC) + 4 + len(header)) % 8)  # the values start 8-byte aligned
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    _remove_orphaned_temporaries(path)
    temporary = f"{path}.tmp.{_HOST}.{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            digest = hashlib.sha256()
            for part in (_MAGIC, struct.pack("<I", len(header)), header, memoryview(sizes), memoryview(flat)):
                digest.update(part)
                file.write(part)
            file.write(digest.digest())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _remove_orphaned_temporaries(path: str) -> None:
    """Delete ``<path>.tmp.<host>.<pid>`` files whose writer, on this host, no longer runs.

    A writer killed between writing its temporary file and ``os.replace`` leaves it behind (as
    large as the cache); the next write for the same cache removes it. Files of a live process,
    of another host (a shared file system), or that cannot be removed are left alone.
    """
    directory = os.path.dirname(path) or "."
    prefix = os.path.basename(path) + ".tmp."
    try:
        names = [name for name in os.listdir(directory) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        host, _, pid = name[len(prefix) :].rpartition(".")
        if host not in (_HOST, "") or not pid.isdigit() or int(pid) == os.getpid() or _running(int(pid)):
            continue  # ("" is the name before the host was part of it: <path>.tmp.<pid>)
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass  # gone meanwhile, or not ours to remove: a leftover is no reason to fail a write


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


def read_cache(path: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray) -> CacheLookup:
    """The cached values for ``key`` when ``path`` holds a whole file for it with these ``lengths``.

    Every byte is read once to check the checksum; the values stay a memory map of the file.
    """
    return _open(path, key, lengths, expected_digest=None)


def map_cache(
    path: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray, digest: bytes
) -> CacheLookup:
    """``read_cache`` for a file another process has checked whole: its trailing sha256 must be ``digest``.

    Reads the header, the lengths and the 32-byte trailer only (no pass over the values).
    """
    return _open(path, key, lengths, expected_digest=digest)


def _open(
    path: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int] | np.ndarray, expected_digest: bytes | None
) -> CacheLookup:
    try:
        blob = np.memmap(path, dtype=np.uint8, mode="c")
    except FileNotFoundError:
        return CacheLookup("missing")
    except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            return CacheLookup("corrupt", reason="it is not a reference-logprob cache file (bad magic bytes)")
        return CacheLookup("corrupt", reason=f"it cannot be read ({error})")
    return _parse(blob, key, lengths, expected_digest)


def _parse(
    blob: np.ndarray, key: CacheKey, lengths: Sequence[int] | np.ndarray, expected_digest: bytes | None = None
) -> CacheLookup:
    prefix = len(_MAGIC) + 4
    if len(blob) < prefix or bytes(blob[: len(_MAGIC)]) != _MAGIC:
        return CacheLookup("corrupt", reason="it is not a reference-logprob cache file (bad magic bytes)")
    (header_size,) = struct.unpack("<I", bytes(blob[len(_MAGIC) : prefix]))
    try:
        header = json.loads(bytes(blob[prefix : prefix + header_size]).decode())
        num_datums, num_values = int(header["num_datums"]), int(header["num_values"])
        stored_key = CacheKey(**header["key"])
        version = header["version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return CacheLookup("corrupt", reason=f"its header is damaged ({type(error).__name__}: {error})")
    if version != _VERSION:
        return CacheLookup("stale", reason=f"it has format version {version!r}, not {_VERSION}", key=stored_key)
    expected_size = prefix + header_size + 8 * num_datums + 4 * num_values + _DIGEST_SIZE
    if len(blob) != expected_size:
        return CacheLookup(
            "corrupt", reason=f"it is truncated or damaged: {len(blob)} bytes where its header promises {expected_size}"
        )
    trailer = bytes(blob[-_DIGEST_SIZE:])
    if expected_digest is None:
        digest = hashlib.sha256()
        step = 64 << 20
        for start in range(0, len(blob) - _DIGEST_SIZE, step):
            digest.update(memoryview(blob[start : min(start + step, len(blob) - _DIGEST_SIZE)]))
        if digest.digest() != trailer:
            return CacheLookup("corrupt", reason="its checksum does not match its contents")
    elif trailer != expected_digest:
        return CacheLookup("corrupt", reason="it is not the file the first rank checked (another checksum)")
    changed = [
        name
        for name in _KEY_NAMES
        if getattr(key, name) is not None and getattr(stored_key, name) != getattr(key, name)
    ]
    if changed:
        return CacheLookup(
            "stale", reason=" and ".join(_KEY_NAMES[name] for name in changed) + " changed", key=stored_key
        )
    start = prefix + header_size
    stored_lengths = np.frombuffer(blob, dtype="<i8", count=num_datums, offset=start)
    if num_datums != len(lengths) or not np.array_equal(stored_lengths, np.asarray(lengths, dtype=np.int64)):
        return CacheLookup("corrupt", reason="its datum lengths do not match the data")
    if int(stored_lengths.sum()) != num_values:
        return CacheLookup("corrupt", reason="its lengths do not add up to its number of values")
    values_start = start + 8 * num_datums
    flat = blob[values_start : values_start + 4 * num_values].view("<f4")
    return CacheLookup("hit", flat=flat, lengths=stored_lengths, digest=trailer, key=stored_key)
