"""The tokenizer: loading it (failing fast when it cannot be had), what a record may pass its chat template, and
calling it on preference examples as TRL 1.x does (batched, a window of a very long text).

Examples:
    >>> from loops_callbacks.data.preference import parse_preference
    >>> from loops_callbacks.demo.hf_data import build_chat_tokenizer
    >>> example = parse_preference({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "item 0")
    >>> tokenizer = build_chat_tokenizer()
    >>> [prompt, chosen, rejected] = tokenize_preferences([example], tokenizer)[0]
    >>> chosen[: len(prompt)] == prompt, len(tokenizer_digests(tokenizer))
    (True, 3)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from loops_callbacks.data.preference import PreferenceExample
from loops_callbacks.data.sources import relative_path_note
from loops_callbacks.data.token_window import shared_start, window_token_ids, worth_a_window
from loops_callbacks.optional import import_optional
from loops_callbacks.progress import ProgressBar

__all__ = ["check_chat_template_kwargs", "check_tokenizer_path", "load_tokenizer", "tokenize_preferences",
           "tokenizer_digests"]

_CHUNK = 256  # records per batched tokenizer call


def load_tokenizer(tokenizer: Any) -> Any:
    """A Hugging Face tokenizer: ``tokenizer`` itself, or ``AutoTokenizer.from_pretrained(tokenizer)`` for a name/path.

    A name is looked up in the local cache first; a path that is not a directory, or a name that
    is not cached while the Hub is offline (``HF_HUB_OFFLINE``), is a ``ValueError`` at once, with the fix.
    """
    if callable(tokenizer) and callable(getattr(tokenizer, "apply_chat_template", None)):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError("tokenizer must be a Hugging Face tokenizer or a name/path for AutoTokenizer.from_pretrained, "
                        f"got {type(tokenizer).__name__}")
    name = os.fspath(tokenizer)
    auto = import_optional("transformers", f"loading the tokenizer {name!r}").AutoTokenizer
    check_tokenizer_path(name)
    if os.path.isdir(name):
        return auto.from_pretrained(name)
    try:
        return auto.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass  # not in the local cache
    missing = f"tokenizer {name!r} is neither a local directory nor in the local Hugging Face cache, and"
    fetch = f"fetch it where there is a network (hf download {name} --exclude '*.safetensors' '*.bin')"
    unavailable = _hub_unavailable()
    if unavailable:
        raise ValueError(f"{missing} {unavailable}: {fetch} or give the path of its directory")
    try:
        return auto.from_pretrained(name)
    except OSError as error:
        raise ValueError(f"{missing} could not be downloaded ({error}); check the name and the network, or give the "
                         "path of its directory") from error


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")


def check_tokenizer_path(name: str, what: str = "tokenizer") -> None:
    """A ``ValueError`` now when ``name`` can only be a path (it is no Hub name) and is not a directory.

    ``what`` names the setting in the message (``"DPODataModule tokenizer"``); a relative path is
    said to be taken from the working directory.

    Examples:
        >>> check_tokenizer_path("Qwen/Qwen2.5-0.5B-Instruct")  # a Hub name: looked up when it is loaded
        >>> check_tokenizer_path("/no/such/tokenizer")
        Traceback (most recent call last):
        ...
        ValueError: tokenizer '/no/such/tokenizer' does not exist: give the directory that holds tokenizer.json ...
    """
    hub_name = _HUB_NAME.fullmatch(name) and not name.startswith((".", "~"))
    if os.path.isdir(name) or (hub_name and not os.path.exists(name)):
        return
    problem = "is a file, not a directory" if os.path.exists(name) else f"does not exist{relative_path_note(name)}"
    raise ValueError(f"{what} {name!r} {problem}: give the directory that holds tokenizer.json / tokenizer_config.json "
                     "(save_pretrained writes one), or a Hugging Face Hub name such as 'Qwen/Qwen2.5-0.5B-Instruct'")


def _hub_unavailable() -> str | None:
    """Why the Hub cannot be used now, or ``None``: offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` as set now;
    ``huggingface_hub`` reads them once, at import), or its host name does not resolve (no network: fail now, not
    after retries)."""
    from huggingface_hub import constants

    flags = (os.environ.get(key, "").upper() for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if any(flag in ("1", "ON", "YES", "TRUE") for flag in flags) or constants.HF_HUB_OFFLINE:
        return "the Hub is offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        return f"the Hub cannot be reached ({host} does not resolve: {error}; set HF_HUB_OFFLINE=1 on machines without one)"
    return None


# apply_chat_template's own arguments and the template's own variables: a record's
# chat_template_kwargs may not set them (the signature adds any a newer transformers has)
_RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


def check_chat_template_kwargs(example: PreferenceExample, tokenizer: Any) -> None:
    """Only template variables pass: an argument of ``apply_chat_template`` or a special token is an error.

    Examples:
        >>> from loops_callbacks.demo.hf_data import build_chat_tokenizer
        >>> from loops_callbacks.data.preference import parse_preference
        >>> example = parse_preference({"prompt": [{"role": "user", "content": "Hi"}],
        ...     "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}],
        ...     "chat_template_kwargs": {"tokenize": False}}, "line 1 of pairs.jsonl")
        >>> check_chat_template_kwargs(example, build_chat_tokenizer())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: line 1 of pairs.jsonl: chat_template_kwargs sets 'tokenize', an argument of apply_chat_template, ...
    """
    if not example.chat_template_kwargs:
        return
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.items()
    reserved = _RESERVED_TEMPLATE_NAMES | {name for name, parameter in parameters
                                           if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)}
    special = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    for key in example.chat_template_kwargs:
        if key in reserved:
            fix = {"chat_template": "; a record cannot replace the chat template: set tokenizer.chat_template",
                   "tools": "; give tools as the record's own 'tools'"}.get(
                key, "; only template variables (such as enable_thinking) may be set per record")
            raise ValueError(f"{example.where}: chat_template_kwargs sets {key!r}, an argument of apply_chat_template, "
                             f"not a template variable{fix}")
        if key in special:
            raise ValueError(f"{example.where}: chat_template_kwargs sets {key!r}, which would replace the tokenizer's "
                             "special token in the template; remove it (set the tokenizer's own special tokens instead)")


def tokenize_preferences(examples: Sequence[PreferenceExample], tokenizer: Any, *, progress: bool = False,
                         max_length: int | None = None, max_prompt_length: int | None = None
                         ) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt_ids, prompt_chosen_ids, prompt_rejected_ids)`` of each text or chat example, as TRL 1.x computes them.

    A chat example is rendered with its chat template, then tokenized without special tokens (what
    ``apply_chat_template(tokenize=True)`` does); a text example is tokenized with them, EOS appended
    to a completion that lacks it. Batched: one tokenizer call per chunk of records, which gives the
    same ids as TRL's one call per record. With a limit, a record much longer than it is tokenized
    from a window of its text (``loops_callbacks.data.token_window``): its lists are then the slices
    of the whole ids that the limits can keep, which give the same pairs.
    """
    checked_keys: set[frozenset[str]] = set()  # the check reads only the keys: once per distinct set
    for example in examples:
        if example.conversational and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{example.where}: a conversational record needs a tokenizer with a chat template, and "
                             f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')!r}) has none; set "
                             "tokenizer.chat_template or use the model's own tokenizer")
        keys = frozenset(example.chat_template_kwargs or ())
        if keys not in checked_keys:
            check_chat_template_kwargs(example, tokenizer)
            checked_keys.add(keys)
    results: list[tuple[list[int], list[int], list[int]]] = [([], [], [])] * len(examples)
    with ProgressBar(progress and bool(examples), len(examples), desc="tokenizing preference pairs", unit="pair") as bar:
        for start in range(0, len(examples), _CHUNK):
            whole: dict[bool, list[tuple[int, list[str]]]] = {True: [], False: []}  # by add_special_tokens
            for index in range(start, min(start + _CHUNK, len(examples))):
                shared, tails, special = _texts(examples[index], tokenizer)
                if worth_a_window(len(shared) + max(map(len, tails)), max_length, max_prompt_length, tokenizer):
                    results[index] = tuple(window_token_ids(tokenizer, shared, tails, add_special_tokens=special,
                                                            max_length=max_length, max_prompt_length=max_prompt_length))
                else:
                    whole[special].append((index, [shared + tail for tail in tails]))
            for special, items in whole.items():
                if items:
                    ids = tokenizer([text for _, texts in items for text in texts], add_special_tokens=special)
                    for number, (index, _) in enumerate(items):
                        results[index] = tuple(list(i) for i in ids["input_ids"][3 * number : 3 * number + 3])
            bar.advance(min(_CHUNK, len(examples) - start))
    return results


def _texts(example: PreferenceExample, tokenizer: Any) -> tuple[str, list[str], bool]:
    """The start the three texts share (prompt, prompt + chosen, prompt + rejected), what follows it in each, and
    whether they are tokenized with special tokens (text records) or not (rendered chats already hold them)."""
    if not example.conversational:
        eos = tokenizer.eos_token
        return example.prompt, ["", *(_with_eos(text, eos) for text in (example.chosen, example.rejected))], True
    kwargs: dict[str, Any] = {"tools": example.tools, **example.chat_template_kwargs}
    texts = []
    for conversation, generation_prompt in ((example.prompt, True), (example.prompt + example.chosen, False),
                                            (example.prompt + example.rejected, False)):
        try:
            texts.append(tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                                       tokenize=False, **kwargs))
        except Exception as error:
            raise ValueError(f"{example.where}: the chat template of {type(tokenizer).__name__} "
                             f"({getattr(tokenizer, 'name_or_path', '')!r}) fails on this record: "
                             f"{type(error).__name__}: {error}") from error
    shared = texts[1][: shared_start(texts)]
    return shared, [text[len(shared) :] for text in texts], False


def _with_eos(text: str, eos: str | None) -> str:
    return text if eos is None or text.endswith(eos) else text + eos


def tokenizer_digests(tokenizer: Any) -> dict[str, str]:
    """Short digests of what makes a tokenizer's ids: its vocabulary and rules, its special tokens, its chat template.

    Examples:
        >>> from loops_callbacks.demo.hf_data import build_chat_tokenizer
        >>> tokenizer = build_chat_tokenizer()
        >>> before = tokenizer_digests(tokenizer)
        >>> tokenizer.chat_template = tokenizer.chat_template + " "
        >>> [name for name, digest in tokenizer_digests(tokenizer).items() if digest != before[name]]
        ['chat template']
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        rules = backend.to_str()
    else:
        vocabulary = getattr(tokenizer, "get_vocab", None)
        rules = json.dumps(sorted(vocabulary().items())) if callable(vocabulary) else repr(tokenizer)
    special = {"class": type(tokenizer).__qualname__, "special_tokens": getattr(tokenizer, "special_tokens_map", None),
               **{key: getattr(tokenizer, key, None) for key in ("add_bos_token", "add_eos_token")}}
    parts = {"tokenizer vocabulary and rules": rules,
             "tokenizer special tokens": json.dumps(special, sort_keys=True, default=str),
             "chat template": json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True, default=str)}
    return {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in parts.items()}
