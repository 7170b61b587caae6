"""Preference records from every common source, each with where it was found: ``read_preference_records``.

Sources: a JSONL, JSON or Parquet file; an in-memory list of dicts; a ``datasets.Dataset`` (a
split of a ``DatasetDict``); or ``datasets.load_dataset`` arguments (``{"path": ..., "name": ...,
"split": ..., "data_files": ...}``). Each record comes with where it was found (``"line 3 of
pairs.jsonl"``, ``"row 7 of pairs.parquet"``), so every error can say; a file that cannot be a
preference file (a directory, a FIFO, bytes that are not UTF-8, a line longer than
``MAX_LINE_BYTES``) is named for what it is, in bounded memory.

Every error and warning names a pair, a datum and a place in a file one way, so that a message can be
searched for (``pair_label``, ``datum_label``, ``file_line``): ``pair 3 (line 8 of pairs.jsonl)``,
``pair 1: the rejected datum (index 3)``.

Examples:
    >>> [r.where for r in read_preference_records([{"chosen": "a", "rejected": "b"}])]
    ['item 0 of the data list']
    >>> pair_label(3, file_line(8, "pairs.jsonl")), datum_label(3)
    ('pair 3 (line 8 of pairs.jsonl)', 'pair 1: the rejected datum (index 3)')
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loops_callbacks.optional import import_optional

__all__ = ["read_preference_records"]

_FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


def pair_label(pair: int, where: str | None = None) -> str:
    """``pair p``, with where it came from in parentheses when known."""
    return f"pair {pair} ({where})" if where else f"pair {pair}"


def file_line(number: int, path: str | os.PathLike[str]) -> str:
    """``line n of path`` (1-based line numbers, as editors count)."""
    return f"line {number} of {os.fspath(path)}"


def datum_label(index: int, where: str | None = None) -> str:
    """Datum ``index`` of interleaved pairs (chosen at even indices, rejected at odd), and where its pair was read."""
    return f"{pair_label(index // 2, where)}: the {'rejected' if index % 2 else 'chosen'} datum (index {index})"


@dataclass(frozen=True)
class LocatedRecord:
    """A record and where it came from (``"line 3 of pairs.jsonl"``)."""

    record: Any
    where: str



def read_preference_records(source: Any) -> list[LocatedRecord]:
    """Every record of ``source``, each with where it was found.

    ``source`` is a path (``.jsonl``, ``.json`` — an array of records or one per line —, or
    ``.parquet``), a ``datasets.Dataset``, ``datasets.load_dataset`` arguments as a dict with
    ``"path"``, or a list of records. Blank JSONL lines are skipped.

    """
    if isinstance(source, (str, os.PathLike)):
        return _read_file(os.fspath(source))
    if _is_dataset_dict(source):
        raise ValueError(f"a DatasetDict holds several splits ({sorted(source)}); pass one, e.g. "
                         f"dataset[{next(iter(source))!r}]")
    if isinstance(source, Mapping):
        return _read_load_dataset(source)
    if type(source).__module__.startswith("datasets.") and hasattr(source, "column_names"):  # a datasets.Dataset
        return _read_dataset(source, "the dataset")
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return [LocatedRecord(record, f"item {index} of the data list") for index, record in enumerate(source)]
    raise TypeError("preference data must be a file path, a list of records, a datasets.Dataset or load_dataset "
                    f"arguments, got {type(source).__name__}")


def _read_file(path: str) -> list[LocatedRecord]:
    kind = next((k for suffix, k in _FILE_KINDS.items() if path.lower().endswith(suffix)), None)
    if kind is not None or os.path.lexists(path):  # a directory or FIFO is named as such, whatever its name
        _check_regular_file(path)
    if kind is None:
        raise ValueError(f"{path!r}: unknown preference file type; use .jsonl, .json or .parquet (or "
                         "dataset={'path': 'json', 'data_files': ...} for anything load_dataset reads)")
    if kind == "parquet":
        parquet = import_optional("pyarrow.parquet", f"reading the Parquet file {path!r}")
        rows = parquet.read_table(path).to_pylist()
        return [LocatedRecord(row, f"row {index} of {path}") for index, row in enumerate(rows)]
    if kind == "json" and _first_character(path) in (b"[", b"{"):
        document = _json_document(_read_utf8(path), path)  # one JSON document is parsed whole
        if isinstance(document, list):
            return [LocatedRecord(item, f"item {index} of {path}") for index, item in enumerate(document)]
        if isinstance(document, Mapping):
            return [LocatedRecord(document, f"the object in {path}")]
    return list(_json_lines(path))


def relative_path_note(path: str | os.PathLike[str]) -> str:
    """For a message about a relative ``path`` that was not found: where it was looked for.

    Examples:
        >>> relative_path_note("/data/pairs.jsonl")
        ''
        >>> relative_path_note("configs/data/pairs.jsonl")  # doctest: +ELLIPSIS
        ' (a relative path is taken from the working directory, ...)'
    """
    return "" if os.path.isabs(path) else f" (a relative path is taken from the working directory, {os.getcwd()})"


def _check_regular_file(path: str) -> None:
    """A ``FileNotFoundError`` for a missing file, a ``ValueError`` for a directory, FIFO, device or symlink loop."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        target = f" (a symlink to {os.readlink(path)!r}, which does not exist)" if os.path.islink(path) else ""
        where = target or relative_path_note(path)
        raise FileNotFoundError(f"preference file {path!r} does not exist{where}") from None
    except OSError as error:  # ELOOP: a symlink loop; EACCES; ENAMETOOLONG ...
        raise ValueError(f"preference file {path!r} cannot be opened: {error.strerror}; give a readable file") from None
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise ValueError(f"preference file {path!r} is a directory; give one .jsonl, .json or .parquet file in it, or "
                         "dataset={'path': 'json', 'data_files': ...} for many")
    what = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "not a regular file"
    raise ValueError(f"preference file {path!r} is {what}; write the records to a regular .jsonl, .json or .parquet file")


def _json_document(text: str, path: str) -> Any:
    """A ``.json`` file read as one JSON document (an array of records, or one record), else ``None`` (JSON Lines).

    A document that starts with ``[`` must parse as one: its error is the one that helps.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: JSON nested deeper than Python's parser allows; flatten the records") from None
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            raise ValueError(f"{path}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
        return None  # maybe one record per line


MAX_LINE_BYTES = 32 << 20
"""The longest line of a JSON Lines file (32 MiB): a longer one (a binary file, say) is refused once that much
is read, so refusing any file takes about twice this in memory, never the whole file."""


def _first_character(path: str) -> bytes:
    """The first byte of ``path`` that is not ASCII whitespace (``b""`` when there is none), read in small chunks."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.lstrip():
                return chunk.lstrip()[:1]
    return b""


def _read_utf8(path: str) -> str:
    """The whole text of ``path``; a ``ValueError`` naming the pair and line of the first line that is not UTF-8."""
    with open(path, "rb") as file:
        raw = file.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    pairs = 0
    for number, line in enumerate(raw.split(b"\n"), start=1):
        pairs += bool(_utf8_line(line, pair_label(pairs, file_line(number, path))).strip())
    raise AssertionError("unreachable: some line is not UTF-8")


def _utf8_line(line: bytes, label: str) -> str:
    """``line`` decoded; a ``ValueError`` naming ``label`` and the first byte that is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{label}: not UTF-8 text (byte {line[error.start]:#04x} at byte {error.start} of the line: "
                         f"{error.reason}); save the file as UTF-8") from None


def _json_lines(path: str) -> Iterator[LocatedRecord]:
    """One record per non-blank line, read one line at a time; lines end at "\\n" only (JSON strings may hold
    U+2028, U+0085), and a line longer than ``MAX_LINE_BYTES`` is an error before more of it is read."""
    count = 0
    with open(path, "rb") as file:
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), start=1):
            label = pair_label(count, file_line(number, path))
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise ValueError(f"{label}: longer than {MAX_LINE_BYTES >> 20} MiB without a line break, which no "
                                 "preference record is (a binary or damaged file?)")
            line = _utf8_line(raw.removesuffix(b"\n"), label)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except RecursionError:
                raise ValueError(f"{label}: JSON nested deeper than Python's parser allows; flatten the record") from None
            except json.JSONDecodeError as error:
                raise ValueError(f"{label}: not valid JSON: {error}{_one_document_hint(path)}") from None
            yield LocatedRecord(record, file_line(number, path))
            count += 1


def _one_document_hint(path: str) -> str:
    """When a JSON Lines file (of at most ``MAX_LINE_BYTES``) is one JSON document over several lines, say so."""
    if os.path.getsize(path) > MAX_LINE_BYTES or _first_character(path) not in (b"[", b"{"):
        return ""
    try:
        document = json.loads(_read_utf8(path))
    except (ValueError, RecursionError):  # json.JSONDecodeError and a line that is not UTF-8 are ValueErrors
        return ""
    what = "an array" if isinstance(document, list) else "an object" if isinstance(document, Mapping) else "a value"
    return (f". The file holds one JSON document ({what}) over several lines, not one record per line: name it "
            f"{os.path.splitext(path)[0]}.json, or write one record per line")


def _is_dataset_dict(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and isinstance(source, Mapping)


def _read_dataset(dataset: Any, label: str) -> list[LocatedRecord]:
    return [LocatedRecord(row, f"row {index} of {label}") for index, row in enumerate(dataset)]


_LOAD_DATASET_KEYS = ("path", "name", "split", "data_files", "data_dir", "revision")


def _read_load_dataset(arguments: Mapping[str, Any]) -> list[LocatedRecord]:
    if "path" not in arguments:
        raise ValueError(f"dataset={dict(arguments)!r}: load_dataset arguments need 'path' (a hub name, a directory, "
                         "or a builder such as 'json' / 'parquet' with data_files)")
    unknown = sorted(set(arguments) - set(_LOAD_DATASET_KEYS))
    if unknown:
        raise ValueError(f"dataset: unknown load_dataset argument(s) {unknown}; use {list(_LOAD_DATASET_KEYS)}")
    datasets = import_optional("datasets", "loading a preference data set with load_dataset")
    kwargs = {key: value for key, value in arguments.items() if value is not None}
    loaded = datasets.load_dataset(**kwargs)
    split = kwargs.get("split")
    if _is_dataset_dict(loaded):
        if len(loaded) != 1:
            raise ValueError(f"dataset={kwargs!r} has several splits ({sorted(loaded)}); choose one with split:")
        split = next(iter(loaded))
        loaded = loaded[split]
    label = f"{kwargs['path']}" + (f" ({kwargs['name']})" if kwargs.get("name") else "") + f" split {split!r}"
    return _read_dataset(loaded, label)
