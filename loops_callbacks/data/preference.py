"""Preference records from every common source, and the format of each, found automatically.

Sources (``read_preference_records``): a JSONL, JSON or Parquet file; an in-memory list of dicts;
a ``datasets.Dataset`` (a split of a ``DatasetDict``); or ``datasets.load_dataset`` arguments
(``{"path": ..., "name": ..., "split": ..., "data_files": ...}``). Each record comes with where it
was found (``"line 3 of pairs.jsonl"``, ``"row 7 of pairs.parquet"``), so every error can say.

Formats (``parse_preference``), TRL's names:

- ``standard``: ``{"prompt": str, "chosen": str, "rejected": str}``;
- ``conversational``: ``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
  messages (``chosen`` / ``rejected`` hold the assistant turn(s));
- ``implicit_standard`` / ``implicit_conversational``: no ``prompt``; ``chosen`` and ``rejected``
  are full texts or conversations whose shared start is the prompt (TRL's ``extract_prompt``);
  a record whose ``prompt`` is a string but whose ``chosen`` / ``rejected`` are conversations is
  implicit too (TRL's ``maybe_extract_prompt``);
- ``token_ids``: ``{"chosen": [ids], "rejected": [ids], "prompt_length": k}`` (or per-token
  ``chosen_weights`` / ``rejected_weights``), the Loops DPO records of ``dpo_records_to_datums``.

Keys whose value is ``None`` count as absent (Arrow fills missing columns with ``None``); other
keys are ignored, except ``tools`` and ``chat_template_kwargs`` of conversational records, which
are passed to the chat template as TRL does.

Example:
    >>> example = parse_preference({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "item 0")
    >>> example.format, example.prompt, example.chosen
    ('standard', '2+2=', '4')
    >>> parse_preference({"chosen": "The sky is blue", "rejected": "The sky is green"}, "item 1").prompt
    'The sky is'
"""

from __future__ import annotations

import json
import numbers
import os
import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loops_callbacks.data.labels import file_line, pair_label
from loops_callbacks.optional import import_optional

__all__ = [
    "USUAL_ROLES",
    "LocatedRecord",
    "PreferenceExample",
    "PreferenceFormat",
    "parse_preference",
    "read_preference_records",
    "unusual_turns",
]

PreferenceFormat = Literal["standard", "conversational", "implicit_standard", "implicit_conversational", "token_ids"]


_FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class LocatedRecord:
    """A record and where it came from (``"line 3 of pairs.jsonl"``)."""

    record: Any
    where: str


@dataclass(frozen=True)
class PreferenceExample:
    """One preference pair in a known format, the implicit prompt already extracted.

    ``prompt``, ``chosen`` and ``rejected`` are strings (standard formats) or lists of messages
    (conversational formats); for ``token_ids`` the original record is in ``record`` and the
    three are empty.
    """

    prompt: Any
    chosen: Any
    rejected: Any
    format: PreferenceFormat
    where: str
    tools: Any = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    record: Mapping[str, Any] | None = None

    @property
    def conversational(self) -> bool:
        return self.format in ("conversational", "implicit_conversational")


# ----------------------------------------------------------------------------- formats


def parse_preference(record: Any, where: str) -> PreferenceExample:
    """The ``PreferenceExample`` of one record; ``ValueError`` naming ``where`` and the keys when it fits no format.

    Example:
        >>> parse_preference({"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1}, "item 0").format
        'token_ids'
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a preference record must be a JSON object / dict, got {type(record).__name__}")
    present = {key: value for key, value in record.items() if value is not None}
    missing = [key for key in ("chosen", "rejected") if key not in present]
    if missing:
        raise ValueError(
            f"{where}: the record has no {' or '.join(repr(k) for k in missing)}, so it fits no preference format "
            f"(keys: {sorted(record)}). {_FORMATS_HELP}"
        )
    chosen, rejected = present["chosen"], present["rejected"]
    kinds = (_kind(chosen), _kind(rejected))
    if kinds == ("ids", "ids"):
        return PreferenceExample("", "", "", "token_ids", where, record=present)
    for key in ("prompt", "chosen", "rejected"):
        _check_unicode(present.get(key), key, where)
    if kinds == ("text", "text"):
        prompt = present.get("prompt")
        if prompt is None:
            prompt, chosen, rejected = _extract_prompt(chosen, rejected, where)
            return PreferenceExample(prompt, chosen, rejected, "implicit_standard", where)
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: 'chosen' and 'rejected' are strings but 'prompt' is {_describe(prompt)}; a standard record "
                f"has a string prompt (keys: {sorted(record)}). {_FORMATS_HELP}"
            )
        return PreferenceExample(prompt, chosen, rejected, "standard", where)
    if kinds == ("messages", "messages"):
        _check_messages(chosen, "chosen", where)
        _check_messages(rejected, "rejected", where)
        tools = _parse_tools(present.get("tools"), where)
        kwargs = present.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"{where}: 'chat_template_kwargs' must be a dict, got {_describe(kwargs)}")
        prompt = present.get("prompt")
        if prompt is None or isinstance(prompt, str):  # a string prompt beside full conversations: implicit
            prompt, chosen, rejected = _extract_prompt(chosen, rejected, where)
            fmt: PreferenceFormat = "implicit_conversational"
        else:
            if _kind(prompt) != "messages" or not prompt:
                raise ValueError(
                    f"{where}: 'chosen' and 'rejected' are conversations but 'prompt' is {_describe(prompt)}; "
                    f"a conversational prompt is a non-empty list of messages (keys: {sorted(record)})"
                )
            _check_messages(prompt, "prompt", where)
            fmt = "conversational"
        return PreferenceExample(list(prompt), list(chosen), list(rejected), fmt, where, tools, dict(kwargs))
    raise ValueError(
        f"{where}: the record fits no preference format: 'chosen' is {_describe(chosen)} and 'rejected' is "
        f"{_describe(rejected)} (keys: {sorted(record)}). {_FORMATS_HELP}"
    )


_FORMATS_HELP = (
    "Formats: standard {prompt, chosen, rejected} strings; conversational lists of {role, content} messages; "
    "implicit prompt (chosen and rejected full texts or conversations, no prompt); or token ids "
    "{chosen: [ids], rejected: [ids], prompt_length: k}."
)


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if hasattr(value, "tolist") and not isinstance(value, Mapping):  # numpy arrays from Arrow / pandas
        value = value.tolist()
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) and "role" in m for m in value):
        return "messages"
    if (
        isinstance(value, Sequence)
        and value
        and isinstance(value[0], numbers.Integral)
        and not isinstance(value[0], bool)
    ):
        return "ids"  # the first id decides; dpo_pair_datums checks every one
    return "other"


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Sequence):
        if not value:
            return "an empty list"
        first = value[0]
        if isinstance(first, Mapping):
            return f"a list of dicts with keys {sorted(first)} (a message needs 'role')"
        return f"a list of {type(first).__name__}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(value: Any, key: str, where: str) -> None:
    r"""A ``ValueError`` naming ``key`` when text in ``value`` holds a lone surrogate (JSON's ``"\ud800"``
    escape without its pair reads as one): no tokenizer takes it.

    Example:
        >>> _check_unicode([{"role": "user", "content": "a" + chr(0xD800)}], "prompt", "line 2 of x.jsonl")
        Traceback (most recent call last):
        ...
        ValueError: line 2 of x.jsonl: prompt[0]['content'] holds a lone surrogate '\ud800' at character 1 ...
    """
    if isinstance(value, str):
        found = _LONE_SURROGATE.search(value)
        if found:
            raise ValueError(
                f"{where}: {key} holds a lone surrogate {found.group()!r} at character {found.start()} (a JSON "
                "escape \\ud800-\\udfff without its pair), which no tokenizer takes; give valid Unicode text"
            )
    elif isinstance(value, Mapping):
        for name, item in value.items():
            _check_unicode(item, f"{key}[{name!r}]", where)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_unicode(item, f"{key}[{index}]", where)


def _parse_tools(tools: Any, where: str) -> list[Any] | None:
    """The record's ``tools``: a list of tool schemas (dicts), given as such or as a JSON string of one."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where}: 'tools' is a string that is not valid JSON ({error}); give a list of tool schemas "
                "(dicts), or a JSON string of one"
            ) from None
    if hasattr(tools, "tolist"):  # numpy arrays from Arrow / pandas
        tools = tools.tolist()
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise ValueError(f"{where}: 'tools' must be a list of tool schemas (dicts), got {_describe(tools)}")
    return tools


def _check_messages(messages: Sequence[Any], name: str, where: str) -> None:
    """Each message has a string role and a ``content`` the chat template can render.

    ``content`` is a string, or a list of text parts ``{"type": "text", "text": str}`` (templates
    that take parts render them; others fail, and the record is named); an assistant message with
    ``tool_calls`` may have none.
    """
    for index, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"{where}: {name}[{index}] has role {role!r}; a message's role must be a string")
        content = message.get("content")
        if content is None:
            if message.get("tool_calls") is not None:
                continue
            raise ValueError(
                f"{where}: {name}[{index}] (role {role!r}) has no 'content' (keys: {sorted(message)}); give every "
                "message a 'content' string (an assistant message with 'tool_calls' may have none)"
            )
        if isinstance(content, str):
            continue
        if hasattr(content, "tolist"):
            content = content.tolist()
        if isinstance(content, list) and content and all(_is_text_part(part) for part in content):
            continue
        raise TypeError(
            f"{where}: {name}[{index}] (role {role!r}) has 'content' that is {_describe(content)}; a message's "
            "content is a string or a non-empty list of text parts {'type': 'text', 'text': str}"
        )


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)


USUAL_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def unusual_turns(example: PreferenceExample) -> list[tuple[str, str]]:
    """``(event, detail)`` for what a conversational example holds that is rarely right.

    ``unusual_role``: a message whose role is outside ``USUAL_ROLES`` (a typo the template renders
    as is); ``completion_not_assistant``: a chosen or rejected completion that does not start with
    an assistant turn, so the next turn's role header is trained as completion.

    Example:
        >>> example = parse_preference({"prompt": [{"role": "user", "content": "Hi"}],
        ...     "chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "asistant", "content": "b"}]}, "x")
        >>> for event in unusual_turns(example):
        ...     print(event)
        ('unusual_role', "rejected[0] has role 'asistant'")
        ('completion_not_assistant', "chosen starts with a 'user' turn")
    """
    if not example.conversational:
        return []
    events = []
    for name, messages in (("prompt", example.prompt), ("chosen", example.chosen), ("rejected", example.rejected)):
        for index, message in enumerate(messages):
            if message["role"] not in USUAL_ROLES:
                events.append(("unusual_role", f"{name}[{index}] has role {message['role']!r}"))
    for name, messages in (("chosen", example.chosen), ("rejected", example.rejected)):
        role = messages[0]["role"] if messages else None
        if role in USUAL_ROLES and role != "assistant":
            events.append(("completion_not_assistant", f"{name} starts with a {role!r} turn"))
    return events


def _extract_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``: the shared start of ``chosen`` and ``rejected`` is the prompt.

    The prompt ends where the two first differ; a space just before that point goes to the
    completions (``"The sky is| blue"``). Where one is a prefix of the other (or they are equal),
    TRL leaves the last element of the shorter one in the completions, so neither is empty; so do
    we. Unlike TRL, an empty chosen or rejected is an error, not a crash, and a difference at the
    very first element gives an empty prompt (TRL would look at the last character instead).
    """
    shortest = min(len(chosen), len(rejected))
    if shortest == 0:
        raise ValueError(f"{where}: an implicit-prompt record needs non-empty 'chosen' and 'rejected'")
    index = next((i for i in range(shortest) if chosen[i] != rejected[i]), shortest - 1)
    if index == shortest - 1 and chosen[index] == rejected[index]:
        pass  # one is a prefix of the other: leave the last shared element to the completions
    elif index > 0 and isinstance(chosen, str) and chosen[index - 1] == " ":
        index -= 1
    return chosen[:index], chosen[index:], rejected[index:]


# ----------------------------------------------------------------------------- sources


def read_preference_records(source: Any, *, description: str | None = None) -> list[LocatedRecord]:
    """Every record of ``source``, each with where it was found.

    ``source`` is a path (``.jsonl``, ``.json`` — an array of records or one per line —, or
    ``.parquet``), a ``datasets.Dataset``, ``datasets.load_dataset`` arguments as a dict with
    ``"path"``, or a list of records. Blank JSONL lines are skipped.

    Example:
        >>> [r.where for r in read_preference_records([{"chosen": "a", "rejected": "b"}])]
        ['item 0 of the data list']
    """
    if isinstance(source, (str, os.PathLike)):
        return _read_file(os.fspath(source))
    if _is_dataset_dict(source):
        raise ValueError(
            f"a DatasetDict holds several splits ({sorted(source)}); pass one, e.g. dataset[{next(iter(source))!r}]"
        )
    if isinstance(source, Mapping):
        return _read_load_dataset(source)
    if _is_dataset(source):
        return _read_dataset(source, description or "the dataset")
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        label = description or "the data list"
        return [LocatedRecord(record, f"item {index} of {label}") for index, record in enumerate(source)]
    raise ValueError(
        f"preference data must be a file path, a list of records, a datasets.Dataset or load_dataset arguments, "
        f"got {type(source).__name__}"
    )


def _read_file(path: str) -> list[LocatedRecord]:
    kind = next((k for suffix, k in _FILE_KINDS.items() if path.lower().endswith(suffix)), None)
    if kind is not None or os.path.lexists(path):  # a directory or FIFO is named as such, whatever its name
        _check_regular_file(path)
    if kind is None:
        raise ValueError(
            f"{path!r}: unknown preference file type; use .jsonl, .json or .parquet "
            "(or dataset={'path': 'json', 'data_files': ...} for anything load_dataset reads)"
        )
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

    Example:
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
    what = (
        "a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "not a regular file"
    )
    hint = (
        "; give one .jsonl, .json or .parquet file in it, or dataset={'path': 'json', 'data_files': ...} for many"
        if stat.S_ISDIR(mode)
        else "; write the records to a regular .jsonl, .json or .parquet file"
    )
    raise ValueError(f"preference file {path!r} is {what}{hint}")


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
            raise ValueError(
                f"{path}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}"
            ) from None
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
        raise ValueError(
            f"{label}: not UTF-8 text (byte {line[error.start]:#04x} at byte {error.start} of the line: "
            f"{error.reason}); save the file as UTF-8"
        ) from None


def _json_lines(path: str) -> Iterator[LocatedRecord]:
    """One record per non-blank line, read one line at a time; lines end at "\\n" only (JSON strings may hold
    U+2028, U+0085), and a line longer than ``MAX_LINE_BYTES`` is an error before more of it is read."""
    count = 0
    with open(path, "rb") as file:
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), start=1):
            label = pair_label(count, file_line(number, path))
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise ValueError(
                    f"{label}: longer than {MAX_LINE_BYTES >> 20} MiB without a line break, which no preference "
                    "record is (a binary or damaged file?)"
                )
            line = _utf8_line(raw.removesuffix(b"\n"), label)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except RecursionError:
                raise ValueError(
                    f"{label}: JSON nested deeper than Python's parser allows; flatten the record"
                ) from None
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
    return (
        f". The file holds one JSON document ({what}) over several lines, not one record per line: name it "
        f"{os.path.splitext(path)[0]}.json, or write one record per line"
    )


def _is_dataset(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and hasattr(source, "column_names")


def _is_dataset_dict(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and isinstance(source, Mapping)


def _read_dataset(dataset: Any, label: str) -> list[LocatedRecord]:
    return [LocatedRecord(row, f"row {index} of {label}") for index, row in enumerate(dataset)]


_LOAD_DATASET_KEYS = ("path", "name", "split", "data_files", "data_dir", "revision")


def _read_load_dataset(arguments: Mapping[str, Any]) -> list[LocatedRecord]:
    if "path" not in arguments:
        raise ValueError(
            f"dataset={dict(arguments)!r}: load_dataset arguments need 'path' (a hub name, a directory, or a "
            "builder such as 'json' / 'parquet' with data_files)"
        )
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
