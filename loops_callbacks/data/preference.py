"""The format of each preference record, found automatically (TRL's names): ``parse_preference``.

- ``standard``: ``{"prompt": str, "chosen": str, "rejected": str}``;
- ``conversational``: ``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
  messages (``chosen`` / ``rejected`` hold the assistant turn(s));
- ``implicit_standard`` / ``implicit_conversational``: no ``prompt``; ``chosen`` and ``rejected``
  are full texts or conversations whose shared start is the prompt (TRL's ``extract_prompt``);
  a record whose ``prompt`` is a string but whose ``chosen`` / ``rejected`` are conversations is
  implicit too (TRL's ``maybe_extract_prompt``);
- ``token_ids``: ``{"chosen": [ids], "rejected": [ids], "prompt_length": k}`` (or per-token
  ``chosen_weights`` / ``rejected_weights``), the Loops DPO records.

Keys whose value is ``None`` count as absent (Arrow fills missing columns with ``None``); other
keys are ignored, except ``tools`` and ``chat_template_kwargs`` of conversational records, which
are passed to the chat template as TRL does. Where the record was read (``"line 3 of
pairs.jsonl"``, ``loops_callbacks.data.sources``) starts every error.

Examples:
    >>> example = parse_preference({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "item 0")
    >>> example.format, example.prompt, example.chosen
    ('standard', '2+2=', '4')
    >>> parse_preference({"chosen": "The sky is blue", "rejected": "The sky is green"}, "item 1").prompt
    'The sky is'
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["USUAL_ROLES", "PreferenceExample", "PreferenceFormat", "parse_preference", "unusual_turns"]

PreferenceFormat = Literal["standard", "conversational", "implicit_standard", "implicit_conversational", "token_ids"]


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


def parse_preference(record: Any, where: str) -> PreferenceExample:
    """The ``PreferenceExample`` of one record; ``ValueError`` naming ``where`` and the keys when it fits no format.

    Examples:
        >>> parse_preference({"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1}, "item 0").format
        'token_ids'
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a preference record must be a JSON object / dict, got {type(record).__name__}")
    present = {key: value for key, value in record.items() if value is not None}
    missing = [key for key in ("chosen", "rejected") if key not in present]
    if missing:
        raise ValueError(f"{where}: the record has no {' or '.join(repr(k) for k in missing)}, so it fits no "
                         f"preference format (keys: {sorted(record)}). {_FORMATS_HELP}")
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
            raise ValueError(f"{where}: 'chosen' and 'rejected' are strings but 'prompt' is {_describe(prompt)}; a "
                             f"standard record has a string prompt (keys: {sorted(record)}). {_FORMATS_HELP}")
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
                raise ValueError(f"{where}: 'chosen' and 'rejected' are conversations but 'prompt' is "
                                 f"{_describe(prompt)}; a conversational prompt is a non-empty list of messages (keys: "
                                 f"{sorted(record)})")
            _check_messages(prompt, "prompt", where)
            fmt = "conversational"
        return PreferenceExample(list(prompt), list(chosen), list(rejected), fmt, where, tools, dict(kwargs))
    raise ValueError(f"{where}: the record fits no preference format: 'chosen' is {_describe(chosen)} and 'rejected' "
                     f"is {_describe(rejected)} (keys: {sorted(record)}). {_FORMATS_HELP}")


_FORMATS_HELP = ("Formats: standard {prompt, chosen, rejected} strings; conversational lists of {role, content} "
                 "messages; implicit prompt (chosen and rejected full texts or conversations, no prompt); or token ids "
                 "{chosen: [ids], rejected: [ids], prompt_length: k}.")


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if hasattr(value, "tolist") and not isinstance(value, Mapping):  # numpy arrays from Arrow / pandas
        value = value.tolist()
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) and "role" in m for m in value):
        return "messages"
    if isinstance(value, Sequence) and value and isinstance(value[0], numbers.Integral) and not isinstance(value[0], bool):
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

    Examples:
        >>> _check_unicode([{"role": "user", "content": "a" + chr(0xD800)}], "prompt", "line 2 of x.jsonl")
        Traceback (most recent call last):
        ...
        ValueError: line 2 of x.jsonl: prompt[0]['content'] holds a lone surrogate '\ud800' at character 1 ...
    """
    if isinstance(value, str):
        found = _LONE_SURROGATE.search(value)
        if found:
            raise ValueError(f"{where}: {key} holds a lone surrogate {found.group()!r} at character {found.start()} "
                             "(a JSON escape \\ud800-\\udfff without its pair), which no tokenizer takes; give valid "
                             "Unicode text")
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
            raise ValueError(f"{where}: 'tools' is a string that is not valid JSON ({error}); give a list of tool "
                             "schemas (dicts), or a JSON string of one") from None
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
            raise ValueError(f"{where}: {name}[{index}] (role {role!r}) has no 'content' (keys: {sorted(message)}); "
                             "give every message a 'content' string (an assistant message with 'tool_calls' may have none)")
        if isinstance(content, str):
            continue
        if hasattr(content, "tolist"):
            content = content.tolist()
        if isinstance(content, list) and content and all(_is_text_part(part) for part in content):
            continue
        raise TypeError(f"{where}: {name}[{index}] (role {role!r}) has 'content' that is {_describe(content)}; a "
                        "message's content is a string or a non-empty list of text parts {'type': 'text', 'text': str}")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)


USUAL_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def unusual_turns(example: PreferenceExample) -> list[tuple[str, str]]:
    """``(event, detail)`` for what a conversational example holds that is rarely right.

    ``unusual_role``: a message whose role is outside ``USUAL_ROLES`` (a typo the template renders
    as is); ``completion_not_assistant``: a chosen or rejected completion that does not start with
    an assistant turn, so the next turn's role header is trained as completion.

    Examples:
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
