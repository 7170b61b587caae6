"""The on-disk cache of reference logprobs: keys, an atomic writer and a reader that trusts nothing.

A cache file holds the ``ref_logprobs`` of every datum of one data set under one reference, and
the key they were computed for: a fingerprint of the reference weights, a fingerprint of the
token data (every datum's ``model_input`` tokens, in order) and the scoring dtype.

File layout (little-endian)::

    b"LOOPSREF"  uint32 header size  header (UTF-8 JSON)  int64 lengths[N]  float64 values[M]  sha256[32]

The trailing sha256 covers every byte before it. ``read_cache`` returns the values only when the
file is whole (size, checksum), its key equals the one asked for, and its lengths equal the
data's; otherwise it says why, and the caller scores again. Values are stored as float64, so a
cached result is bit-for-bit the one that was scored.

Example:
    >>> import os, tempfile
    >>> import numpy as np
    >>> key = CacheKey(reference="r", data=data_fingerprint([[1, 2], [3]]), dtype="float32")
    >>> path = os.path.join(tempfile.mkdtemp(), CACHE_FILE_NAME)
    >>> write_cache(path, key, [np.array([-0.5, 0.0]), np.array([0.0])])
    >>> lookup = read_cache(path, key, [2, 1])
    >>> lookup.status, [v.tolist() for v in lookup.values]
    ('hit', [[-0.5, 0.0], [0.0]])
    >>> read_cache(path, CacheKey("other", key.data, "float32"), [2, 1]).reason
    'the reference weights changed'
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["CACHE_FILE_NAME", "CacheKey", "CacheLookup", "data_fingerprint", "read_cache", "write_cache"]

CACHE_FILE_NAME = "ref_logprobs.cache"
_MAGIC = b"LOOPSREF"
_VERSION = 1
_DIGEST_SIZE = 32
_KEY_NAMES = {"reference": "the reference weights", "data": "the data", "dtype": "the scoring dtype"}


@dataclass(frozen=True)
class CacheKey:
    """What the cached values depend on; a file made for another key is never used."""

    reference: str
    data: str
    dtype: str


@dataclass
class CacheLookup:
    """The outcome of ``read_cache``: ``values`` when ``status == "hit"``, else why not (``reason``).

    ``status`` is ``"hit"``, ``"missing"`` (no file), ``"stale"`` (a whole file made for another
    key) or ``"corrupt"`` (a truncated or damaged file, or one whose lengths do not fit the data).
    """

    status: Literal["hit", "missing", "stale", "corrupt"]
    values: list[np.ndarray] | None = None
    reason: str = ""


def data_fingerprint(token_lists: Sequence[Sequence[int]]) -> str:
    """sha256 of the datums' token ids and their order (and of where each datum starts and ends).

    Example:
        >>> data_fingerprint([[1, 2], [3]]) == data_fingerprint([[1], [2, 3]])
        False
    """
    lengths = np.fromiter((len(tokens) for tokens in token_lists), dtype="<i8", count=len(token_lists))
    flat = np.fromiter((t for tokens in token_lists for t in tokens), dtype="<i8", count=int(lengths.sum()))
    digest = hashlib.sha256(b"loops-callbacks token data v1\n")
    digest.update(lengths.tobytes())
    digest.update(flat.tobytes())
    return digest.hexdigest()


def write_cache(path: str | os.PathLike[str], key: CacheKey, values: Sequence[np.ndarray]) -> None:
    """Write ``values`` (one 1-D array per datum) for ``key``: a temporary file, then ``os.replace``.

    A reader sees the old file or the new one, never a partial one. Creates the directory.
    """
    path = os.fspath(path)
    lengths = np.array([len(v) for v in values], dtype="<i8")
    flat = np.concatenate([np.asarray(v, dtype="<f8").reshape(-1) for v in values]) if values else np.zeros(0, "<f8")
    header = json.dumps(
        {"version": _VERSION, "key": dataclasses.asdict(key), "num_datums": len(lengths), "num_values": len(flat)},
        sort_keys=True,
    ).encode()
    body = b"".join([_MAGIC, struct.pack("<I", len(header)), header, lengths.tobytes(), flat.astype("<f8").tobytes()])
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            file.write(body)
            file.write(hashlib.sha256(body).digest())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def read_cache(path: str | os.PathLike[str], key: CacheKey, lengths: Sequence[int]) -> CacheLookup:
    """The cached values for ``key`` when ``path`` holds a whole file for it with these ``lengths``."""
    try:
        with open(path, "rb") as file:
            blob = file.read()
    except FileNotFoundError:
        return CacheLookup("missing")
    except OSError as error:
        return CacheLookup("corrupt", reason=f"it cannot be read ({error})")
    return _parse(blob, key, lengths)


def _parse(blob: bytes, key: CacheKey, lengths: Sequence[int]) -> CacheLookup:
    prefix = len(_MAGIC) + 4
    if len(blob) < prefix or blob[: len(_MAGIC)] != _MAGIC:
        return CacheLookup("corrupt", reason="it is not a reference-logprob cache file (bad magic bytes)")
    (header_size,) = struct.unpack("<I", blob[len(_MAGIC) : prefix])
    try:
        header = json.loads(blob[prefix : prefix + header_size].decode())
        num_datums, num_values = int(header["num_datums"]), int(header["num_values"])
        stored_key = CacheKey(**header["key"])
        version = header["version"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return CacheLookup("corrupt", reason=f"its header is damaged ({type(error).__name__}: {error})")
    expected_size = prefix + header_size + 8 * (num_datums + num_values) + _DIGEST_SIZE
    if len(blob) != expected_size:
        return CacheLookup(
            "corrupt", reason=f"it is truncated or damaged: {len(blob)} bytes where its header promises {expected_size}"
        )
    if hashlib.sha256(blob[:-_DIGEST_SIZE]).digest() != blob[-_DIGEST_SIZE:]:
        return CacheLookup("corrupt", reason="its checksum does not match its contents")
    if version != _VERSION:
        return CacheLookup("stale", reason=f"it has format version {version!r}, not {_VERSION}")
    changed = [name for name, label in _KEY_NAMES.items() if getattr(stored_key, name) != getattr(key, name)]
    if changed:
        return CacheLookup("stale", reason=" and ".join(_KEY_NAMES[name] for name in changed) + " changed")
    start = prefix + header_size
    stored_lengths = np.frombuffer(blob, dtype="<i8", count=num_datums, offset=start)
    if num_datums != len(lengths) or not np.array_equal(stored_lengths, np.asarray(lengths, dtype=np.int64)):
        return CacheLookup("corrupt", reason="its datum lengths do not match the data")
    if int(stored_lengths.sum()) != num_values:
        return CacheLookup("corrupt", reason="its lengths do not add up to its number of values")
    flat = np.frombuffer(blob, dtype="<f8", count=num_values, offset=start + 8 * num_datums).astype(np.float64)
    bounds = np.cumsum(stored_lengths)[:-1]
    return CacheLookup("hit", values=list(np.split(flat, bounds)) if num_datums else [])
