"""Preference pairs to Loops DPO datums with a Hugging Face tokenizer, as TRL's ``DPOTrainer`` tokenizes them.

For each pair (``parse_preference`` has found its format and extracted an implicit prompt):

1. the prompt and the prompt + completion are tokenized *together*, as TRL 1.x does:
   conversational records with the tokenizer's chat template (the prompt with the generation
   prompt, ``prompt + chosen`` without it; the record's ``tools`` and ``chat_template_kwargs``
   passed along), standard records with ``tokenizer(text)`` after appending the EOS token to a
   ``chosen`` / ``rejected`` that lacks it;
2. the completion starts where the tokenized prompt and the tokenized prompt + completion first
   differ (the earlier point of the chosen and the rejected sequence, so that both share one
   prompt): that is ``prompt_length``. When it is not the end of the tokenized prompt (a chat
   template that renders the prompt alone differently, tokens merging across the boundary),
   TRL's warning is given, once, with a count. The training sequence is the tokenized
   prompt + completion itself;
3. limits: ``max_prompt_length`` keeps the *end* of a longer prompt (so the completion survives;
   TRL 1.x has no such limit), then ``max_length`` keeps the *start* of a longer sequence, as
   TRL's ``truncation_mode="keep_start"`` does, and pairs whose prompt alone fills ``max_length``
   are dropped (as TRL drops them). A pair left without a completion token in either sequence
   is dropped, never trained on. Truncated and dropped pairs are counted and reported in one
   warning, on rank 0;
4. datums in the Loops DPO convention (``dpo_pair_datums``): the full sequence in
   ``model_input``, weight 1 on the positions that predict completion tokens.

Token-id records (``{"chosen": [ids], "rejected": [ids], "prompt_length": k}``) skip step 1 and
2 and get the same limits.

Example:
    >>> from loops_callbacks.demo.hf_data import build_chat_tokenizer
    >>> tokenizer = build_chat_tokenizer()
    >>> records = [{"prompt": [{"role": "user", "content": "Hi"}],
    ...             "chosen": [{"role": "assistant", "content": "Hello!"}],
    ...             "rejected": [{"role": "assistant", "content": "Go away."}]}]
    >>> pairs, report = preference_pairs(records, tokenizer, progress=False)
    >>> prompt = tokenizer.apply_chat_template(records[0]["prompt"], add_generation_prompt=True)["input_ids"]
    >>> pairs.input_ids[: len(prompt)].tolist() == prompt, report.num_pairs
    (True, 1)
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loops_callbacks import run_warnings
from loops_callbacks.data.dpo import pair_rows, prompt_rows
from loops_callbacks.data.labels import pair_label
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.data.preference import (
    USUAL_ROLES,
    LocatedRecord,
    PreferenceExample,
    parse_preference,
    read_preference_records,
    relative_path_note,
    unusual_turns,
)
from loops_callbacks.data.token_window import common_prefix_length, shared_start, window_token_ids, worth_a_window
from loops_callbacks.optional import import_optional
from loops_callbacks.progress import ProgressBar
from loops_callbacks.types import Datum
from loops_callbacks.validation import check_int

__all__ = [
    "PreferenceDataWarning",
    "TokenizationReport",
    "apply_length_limits",
    "check_limits",
    "check_tokenizer_path",
    "load_tokenizer",
    "preference_pairs",
    "read_dpo_jsonl",
    "tokenize_records",
]

_CHUNK = 256  # records per batched tokenizer call


class PreferenceDataWarning(UserWarning):
    """Preference pairs were truncated or dropped by the length limits, or hold something rarely right.

    (A prompt split inside the tokenized prompt, identical chosen and rejected sequences, an
    unusual message role, a completion that is not an assistant turn.)
    """


@dataclass
class TokenizationReport:
    """What ``preference_datums`` did to the pairs: formats seen, truncations and drops.

    ``prompt_not_prefix`` counts pairs whose tokenized prompt is not a prefix of the tokenized
    prompt + completion (TRL's warning), except those dropped because their prompt fills
    ``max_length`` (their split is never trained on); ``prompt_truncated`` pairs lost the start of their prompt
    to ``max_prompt_length``; ``truncated`` lost the end of a sequence to ``max_length``;
    ``dropped_prompt_fills_max_length`` and ``dropped_empty_completion`` were left out;
    ``identical`` kept pairs have the same chosen and rejected sequence (no gradient);
    ``unusual_role`` / ``completion_not_assistant`` count conversational records with a message role
    outside ``USUAL_ROLES`` / a completion that does not start with an assistant turn;
    ``record_indices[p]`` is the index of the record that became pair ``p``.
    """

    num_records: int = 0
    num_pairs: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    prompt_not_prefix: int = 0
    prompt_truncated: int = 0
    truncated: int = 0
    dropped_prompt_fills_max_length: int = 0
    dropped_empty_completion: int = 0
    identical: int = 0
    unusual_role: int = 0
    completion_not_assistant: int = 0
    record_indices: list[int] = field(default_factory=list)  # the record of each kept pair, in order
    examples: dict[str, str] = field(default_factory=dict)  # first occurrence of each event: where (and what)

    def note(self, event: str, where: str) -> None:
        setattr(self, event, getattr(self, event) + 1)
        self.examples.setdefault(event, where)

    def warning(self) -> str | None:
        """One message for everything worth a warning, or ``None``."""
        parts = []
        if self.prompt_not_prefix:
            parts.append(
                f"{self.prompt_not_prefix} pair(s) have a tokenized prompt that is not a prefix of the tokenized "
                "prompt+completion, usually because the chat template renders the prompt alone differently or "
                "because tokens merge across the boundary; their completion starts where the two diverge, and the "
                f"rest of the prompt is left out of the training sequence (first: {self.examples['prompt_not_prefix']}). "
                "The model is trained on a context that differs from the one it sees at inference: use a chat template "
                "that renders the prompt the same way in both cases, or end the prompt on a token boundary"
            )
        for event, text in (
            ("prompt_truncated", "had their prompt cut to its last max_prompt_length tokens"),
            ("truncated", "had a sequence cut to its first max_length tokens"),
            ("dropped_prompt_fills_max_length", "were dropped: their prompt alone fills max_length"),
            ("dropped_empty_completion", "were dropped: no completion token left in the chosen or rejected sequence"),
            (
                "identical",
                "have the same chosen and rejected sequence, so they give no gradient and only cost compute: "
                "remove them",
            ),
            (
                "unusual_role",
                f"have a message role outside {sorted(USUAL_ROLES)}, which the chat template renders as is: "
                "check for a typo",
            ),
            (
                "completion_not_assistant",
                "have a chosen or rejected completion that does not start with an assistant turn, so that turn's "
                "role header is trained as completion",
            ),
        ):
            count = getattr(self, event)
            if count:
                parts.append(f"{count} of {self.num_records} pair(s) {text} (first: {self.examples[event]})")
        return "; ".join(parts) + "." if parts else None


def load_tokenizer(tokenizer: Any) -> Any:
    """A Hugging Face tokenizer: ``tokenizer`` itself, or ``AutoTokenizer.from_pretrained(tokenizer)`` for a name/path.

    A name is looked up in the local cache first; a path that is not a directory, or a name that
    is not cached while the Hub is offline (``HF_HUB_OFFLINE``), is a ``ValueError`` at once.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        name = os.fspath(tokenizer)
        transformers = import_optional("transformers", f"loading the tokenizer {name!r}")
        return _from_pretrained(transformers.AutoTokenizer, name)
    if callable(tokenizer) and callable(getattr(tokenizer, "apply_chat_template", None)):
        return tokenizer
    raise TypeError(
        f"tokenizer must be a Hugging Face tokenizer or a name/path for AutoTokenizer.from_pretrained, "
        f"got {type(tokenizer).__name__}"
    )


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")


def check_tokenizer_path(name: str, what: str = "tokenizer") -> None:
    """A ``ValueError`` now when ``name`` can only be a path (it is no Hub name) and is not a directory.

    ``what`` names the setting in the message (``"DPODataModule tokenizer"``); a relative path is
    said to be taken from the working directory.

    Example:
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
    raise ValueError(
        f"{what} {name!r} {problem}: give the directory that holds tokenizer.json / tokenizer_config.json "
        "(save_pretrained writes one), or a Hugging Face Hub name such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def _from_pretrained(auto: Any, name: str) -> Any:
    """``auto.from_pretrained(name)``, failing fast with the fix for a missing path or an uncached name offline."""
    check_tokenizer_path(name)
    if os.path.isdir(name):
        return auto.from_pretrained(name)
    try:
        return auto.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass  # not in the local cache
    if _hub_offline():
        raise ValueError(
            f"tokenizer {name!r} is neither a local directory nor in the local Hugging Face cache, and the Hub is "
            f"offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE): fetch it where there is a network "
            f"(hf download {name} --exclude '*.safetensors' '*.bin') or give the path of its directory"
        )
    unreachable = _hub_unreachable()
    if unreachable:
        raise ValueError(
            f"tokenizer {name!r} is neither a local directory nor in the local Hugging Face cache, and the Hub cannot "
            f"be reached ({unreachable}): fetch it where there is a network (hf download {name} --exclude "
            "'*.safetensors' '*.bin') or give the path of its directory; set HF_HUB_OFFLINE=1 on machines without one"
        )
    try:
        return auto.from_pretrained(name)
    except OSError as error:
        raise ValueError(
            f"tokenizer {name!r} is neither a local directory nor in the local Hugging Face cache, and could not be "
            f"downloaded ({error}); check the name and the network, or give the path of its directory"
        ) from error


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached when its host name does not resolve (no network: fail now, not after retries)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except ImportError:
        endpoint = "https://huggingface.co"
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as error:
        return f"{host} does not resolve: {error}"
    return None


def _hub_offline() -> bool:
    if any(
        os.environ.get(key, "").upper() in ("1", "ON", "YES", "TRUE")
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


# apply_chat_template's own arguments and the template's own variables: a record's
# chat_template_kwargs may not set them (the signature adds any a newer transformers has)
_RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


def check_chat_template_kwargs(example: PreferenceExample, tokenizer: Any) -> None:
    """Only template variables pass: an argument of ``apply_chat_template`` or a special token is an error.

    Example:
        >>> from loops_callbacks.demo.hf_data import build_chat_tokenizer
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
    reserved = _RESERVED_TEMPLATE_NAMES | {
        name
        for name, parameter in inspect.signature(tokenizer.apply_chat_template).parameters.items()
        if parameter.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    special = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    for key in example.chat_template_kwargs:
        if key in reserved:
            fix = {
                "chat_template": "; a record cannot replace the chat template: set tokenizer.chat_template",
                "tools": "; give tools as the record's own 'tools'",
            }.get(key, "; only template variables (such as enable_thinking) may be set per record")
            raise ValueError(
                f"{example.where}: chat_template_kwargs sets {key!r}, an argument of apply_chat_template, not a "
                f"template variable{fix}"
            )
        if key in special:
            raise ValueError(
                f"{example.where}: chat_template_kwargs sets {key!r}, which would replace the tokenizer's special "
                "token in the template; remove it (set the tokenizer's own special tokens instead)"
            )


def tokenize_preferences(
    examples: Sequence[PreferenceExample],
    tokenizer: Any,
    *,
    progress: bool = False,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt_ids, prompt_chosen_ids, prompt_rejected_ids)`` of each text or chat example, as TRL 1.x computes them.

    Batched: one tokenizer call per chunk of records (and per distinct ``tools`` /
    ``chat_template_kwargs``), which gives the same ids as TRL's one call per record. With a
    limit, a record much longer than it is tokenized from a window of its text
    (``loops_callbacks.data.token_window``): its lists are then the slices of the whole ids that
    the limits can keep, which give the same datums.
    """
    checked_keys: set[frozenset[str]] = set()  # the check reads only the keys: once per distinct set
    for example in examples:
        if example.conversational and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{example.where}: a conversational record needs a tokenizer with a chat template, and "
                f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')!r}) has none; set "
                "tokenizer.chat_template or use the model's own tokenizer"
            )
        keys = frozenset(example.chat_template_kwargs or ())
        if keys not in checked_keys:
            check_chat_template_kwargs(example, tokenizer)
            checked_keys.add(keys)
    results: list[tuple[list[int], list[int], list[int]]] = [([], [], [])] * len(examples)
    shown = progress and bool(examples)
    with ProgressBar(shown, len(examples), desc="tokenizing preference pairs", unit="pair") as bar:
        for start in range(0, len(examples), _CHUNK):
            groups: dict[str, list[int]] = {}
            for index in range(start, min(start + _CHUNK, len(examples))):
                example = examples[index]
                if worth_a_window(_text_length(example), max_length, max_prompt_length, tokenizer):
                    results[index] = _window_ids(example, tokenizer, max_length, max_prompt_length)
                else:
                    groups.setdefault(_call_key(example), []).append(index)
            for indices in groups.values():
                for index, ids in zip(indices, _tokenize_group([examples[i] for i in indices], tokenizer)):
                    results[index] = ids
            bar.advance(min(_CHUNK, len(examples) - start))
    return results


def _text_length(example: PreferenceExample) -> int:
    """The characters of the longer of prompt + chosen and prompt + rejected (message contents for chats)."""
    if not example.conversational:
        return len(example.prompt) + max(len(example.chosen), len(example.rejected))

    def characters(messages: list[Any]) -> int:
        total = 0
        for message in messages:
            content = message.get("content")
            total += len(content) if isinstance(content, str) else sum(len(p["text"]) for p in content or [])
        return total

    return characters(example.prompt) + max(characters(example.chosen), characters(example.rejected))


def _window_ids(
    example: PreferenceExample, tokenizer: Any, max_length: int | None, max_prompt_length: int | None
) -> tuple[list[int], list[int], list[int]]:
    """One long example's ids from a window of its text (``window_token_ids``)."""
    if example.conversational:
        kwargs: dict[str, Any] = {"tools": example.tools, **example.chat_template_kwargs}
        texts = []
        for conversation, generation_prompt in (
            (example.prompt, True),
            (example.prompt + example.chosen, False),
            (example.prompt + example.rejected, False),
        ):
            try:  # as apply_chat_template(tokenize=True) does: render, then tokenize without special tokens
                texts.append(
                    tokenizer.apply_chat_template(
                        conversation, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
                    )
                )
            except Exception as error:
                _name_the_failing_record([example], [conversation], generation_prompt, kwargs, tokenizer, error)
                raise
        shared, special = texts[1][: shared_start(texts)], False
        tails = [text[len(shared) :] for text in texts]
    else:
        eos = tokenizer.eos_token
        shared, special = example.prompt, True
        tails = ["", _with_eos(example.chosen, eos), _with_eos(example.rejected, eos)]
    prompt, chosen, rejected = window_token_ids(
        tokenizer, shared, tails, add_special_tokens=special, max_length=max_length, max_prompt_length=max_prompt_length
    )
    return prompt, chosen, rejected


def _call_key(example: PreferenceExample) -> str:
    if not example.conversational:
        return "text"
    return json.dumps([example.tools, example.chat_template_kwargs], sort_keys=True, default=str)


def _tokenize_group(examples: list[PreferenceExample], tokenizer: Any) -> list[tuple[list[int], list[int], list[int]]]:
    if examples[0].conversational:
        kwargs: dict[str, Any] = {"tools": examples[0].tools, **examples[0].chat_template_kwargs}

        def render(conversations: list[list[Any]], generation_prompt: bool) -> list[list[int]]:
            try:
                encoded = tokenizer.apply_chat_template(
                    conversations, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True, **kwargs
                )
            except Exception as error:
                _name_the_failing_record(examples, conversations, generation_prompt, kwargs, tokenizer, error)
                raise
            return [list(ids) for ids in encoded["input_ids"]]

        prompts = render([e.prompt for e in examples], True)
        chosen = render([e.prompt + e.chosen for e in examples], False)
        rejected = render([e.prompt + e.rejected for e in examples], False)
    else:
        eos = tokenizer.eos_token
        texts = [e.prompt for e in examples]
        texts += [e.prompt + _with_eos(e.chosen, eos) for e in examples]
        texts += [e.prompt + _with_eos(e.rejected, eos) for e in examples]
        ids = [list(i) for i in tokenizer(texts)["input_ids"]]
        count = len(examples)
        prompts, chosen, rejected = ids[:count], ids[count : 2 * count], ids[2 * count :]
    return list(zip(prompts, chosen, rejected))


def _name_the_failing_record(
    examples: list[PreferenceExample],
    conversations: list[list[Any]],
    generation_prompt: bool,
    kwargs: dict[str, Any],
    tokenizer: Any,
    error: Exception,
) -> None:
    """A batch the chat template failed on: a ``ValueError`` naming the first record it fails on alone."""
    for example, conversation in zip(examples, conversations):
        try:
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )
        except Exception as own:
            raise ValueError(
                f"{example.where}: the chat template of {type(tokenizer).__name__} "
                f"({getattr(tokenizer, 'name_or_path', '')!r}) fails on this record: {type(own).__name__}: {own}"
            ) from error


def _with_eos(text: str, eos: str | None) -> str:
    return text if eos is None or text.endswith(eos) else text + eos


def apply_length_limits(
    chosen: list[int],
    rejected: list[int],
    prompt_length: int,
    *,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
) -> tuple[list[int], list[int], int, list[str]]:
    """The pair within the limits, and what happened (events of ``TokenizationReport``; a ``dropped_*`` one means drop it).

    ``max_prompt_length`` keeps the last tokens of a longer prompt; then ``max_length`` keeps the
    first tokens of a longer sequence, and a prompt that fills it drops the pair.

    Example:
        >>> apply_length_limits([1, 2, 3, 4, 5], [1, 2, 3, 6], 3, max_length=4, max_prompt_length=2)
        ([2, 3, 4, 5], [2, 3, 6], 2, ['prompt_truncated'])
        >>> apply_length_limits([1, 2, 3, 4, 5], [1, 2, 3, 6], 3, max_length=4)
        ([1, 2, 3, 4], [1, 2, 3, 6], 3, ['truncated'])
    """
    events: list[str] = []
    if max_prompt_length is not None and prompt_length > max_prompt_length:
        cut = prompt_length - max_prompt_length
        chosen, rejected, prompt_length = chosen[cut:], rejected[cut:], max_prompt_length
        events.append("prompt_truncated")
    if max_length is not None:
        if prompt_length >= max_length:
            return chosen, rejected, prompt_length, [*events, "dropped_prompt_fills_max_length"]
        if len(chosen) > max_length or len(rejected) > max_length:
            chosen, rejected = chosen[:max_length], rejected[:max_length]
            events.append("truncated")
    if len(chosen) <= prompt_length or len(rejected) <= prompt_length:
        events.append("dropped_empty_completion")
    return chosen, rejected, prompt_length, events


def preference_pairs(
    source: Any,
    tokenizer: Any = None,
    *,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    progress: bool = True,
    warn: bool = True,
) -> tuple[PackedPairs, TokenizationReport]:
    """Interleaved DPO pairs (chosen at even indices, rejected at odd) from preference records, packed:
    each sequence's ids, targets and weights go straight into flat arrays (no datum is made).

    Args:
        source: anything ``read_preference_records`` reads (a file path, a list of records, a
            ``datasets.Dataset``, ``load_dataset`` arguments), or already located records.
        tokenizer: a Hugging Face tokenizer or its name/path; needed for text and chat records.
        max_length: longest sequence (prompt + completion) in tokens; keeps the start.
        max_prompt_length: longest prompt in tokens; keeps the end.
        progress: a progress bar while tokenizing.
        warn: one ``PreferenceDataWarning`` (rank 0) summing up truncations, drops and prompt splits.

    Raises:
        ValueError: a record that fits no format (naming its file and line, or row, and its keys),
            bad limits, a missing tokenizer or chat template, or no pair left.
    """
    check_limits(max_length, max_prompt_length)
    is_located = isinstance(source, list) and bool(source) and isinstance(source[0], LocatedRecord)
    located = list(source) if is_located else read_preference_records(source)
    pairs, report = tokenize_records(located, tokenizer, max_length=max_length, max_prompt_length=max_prompt_length,
                                     progress=progress)
    return kept_pairs(pairs, report, warn=warn)


def kept_pairs(pairs: PackedPairs, report: TokenizationReport, *, warn: bool = True
               ) -> tuple[PackedPairs, TokenizationReport]:
    """``pairs`` and ``report``, when any pair was kept (a ``ValueError`` saying why none was otherwise), after the one
    ``PreferenceDataWarning`` of what was truncated, dropped or doubtful (``warn``)."""
    message = report.warning()
    if not len(pairs):
        raise ValueError(f"no preference pair left out of {report.num_records} record(s): {message or 'the data are empty'}")
    if message and warn:
        run_warnings.warn(message, PreferenceDataWarning)
    return pairs, report


def tokenize_records(located: Sequence[LocatedRecord], tokenizer: Any, *, max_length: int | None = None,
                     max_prompt_length: int | None = None, progress: bool = False
                     ) -> tuple[PackedPairs, TokenizationReport]:
    """``preference_pairs`` of located records without its last step (``kept_pairs``): they may keep no pair."""
    report = TokenizationReport(num_records=len(located))
    examples = [parse_preference(item.record, item.where) for item in located]
    for example in examples:
        report.formats[example.format] = report.formats.get(example.format, 0) + 1
        for event, detail in dict(unusual_turns(example)).items():  # each event once per record
            report.note(event, f"{example.where}: {detail}")
    text = [i for i, e in enumerate(examples) if e.format != "token_ids"]
    tokenized: dict[int, tuple[list[int], list[int], list[int]]] = {}
    if text:
        if tokenizer is None:
            raise ValueError(f"{examples[text[0]].where}: {examples[text[0]].format} records are text and need a "
                             "tokenizer (a Hugging Face tokenizer, or its name/path)")
        tokenizer = load_tokenizer(tokenizer)
        ids = tokenize_preferences([examples[i] for i in text], tokenizer, progress=progress, max_length=max_length,
                                   max_prompt_length=max_prompt_length)
        tokenized = dict(zip(text, ids))
    rows: list[dict[str, np.ndarray]] = []
    limited = max_length is not None or max_prompt_length is not None
    for index, example in enumerate(examples):
        split: int | None = None
        if example.format == "token_ids":
            record, label = example.record or {}, pair_label(index, example.where)
            try:
                pair = pair_rows(record["chosen"], record["rejected"], record.get("prompt_length"),
                                 chosen_weights=record.get("chosen_weights"),
                                 rejected_weights=record.get("rejected_weights"))
            except (TypeError, ValueError) as error:
                raise type(error)(f"{label}: {error}") from None
            if not limited or record.get("prompt_length") is None:
                if limited:
                    _check_weighted_within_limits(record, label, max_length, max_prompt_length)
                _keep(rows, report, index, example.where, pair)
                continue
            chosen, rejected = list(record["chosen"]), list(record["rejected"])
            prompt_length = int(record["prompt_length"])
        else:
            prompt_ids, chosen, rejected = tokenized[index]
            prompt_length = min(common_prefix_length(prompt_ids, chosen), common_prefix_length(prompt_ids, rejected))
            split = prompt_length if prompt_length < len(prompt_ids) else None  # TRL's warning, if kept
            if prompt_length == 0:
                prompt_length = 1  # token 0 is never predicted (nor by TRL); its two sequences must share it
                if chosen[:1] != rejected[:1]:
                    _note_prompt_split(report, example.where, prompt_ids, 0, tokenizer)
                    report.note("dropped_empty_completion", example.where)
                    continue
        chosen, rejected, prompt_length, events = apply_length_limits(
            chosen, rejected, prompt_length, max_length=max_length, max_prompt_length=max_prompt_length
        )
        if split is not None and "dropped_prompt_fills_max_length" not in events:
            _note_prompt_split(report, example.where, prompt_ids, split, tokenizer)
        for event in events:
            report.note(event, example.where)
        if not any(event.startswith("dropped") for event in events):
            _keep(rows, report, index, example.where, prompt_rows(chosen, rejected, prompt_length))
    report.num_pairs = len(rows) // 2
    where = tuple(located[index].where for index in report.record_indices)
    return PackedPairs.from_rows(rows, where=where), report


def _keep(rows: list[dict[str, np.ndarray]], report: TokenizationReport, index: int, where: str,
          pair: list[dict[str, np.ndarray]]) -> None:
    """Record ``index``'s pair kept, counted ``identical`` when its two sequences hold the same tokens and weights."""
    if all(np.array_equal(pair[0][key], pair[1][key]) for key in ("input_ids", "weights")):
        report.note("identical", where)
    rows.extend(pair)
    report.record_indices.append(index)


def read_dpo_jsonl(path: str | os.PathLike[str]) -> list[Datum]:
    """Interleaved datums from a JSONL file of token-id records, as ``DPODataModule(path=...)`` reads it.

    The records are ``{"chosen", "rejected", "prompt_length"}`` (or the two weights), blank lines
    skipped; they go through the DataModule's own reader (``preference_pairs``), so the errors are
    the same: a ``ValueError`` naming the pair and the line of the file (also for text that is not UTF-8).
    """
    return preference_pairs(os.fspath(path), progress=False)[0].datums()


def _note_prompt_split(report: TokenizationReport, where: str, prompt_ids: list[int], split: int,
                       tokenizer: Any) -> None:
    """TRL's warning: the completion starts at token ``split``, inside the tokenized prompt (its end is shown)."""
    report.note("prompt_not_prefix", f"{where}, prompt end {tokenizer.decode(prompt_ids[split:])!r} left out")


def _check_weighted_within_limits(record: Mapping[str, Any], label: str, max_length: int | None,
                                  max_prompt_length: int | None) -> None:
    """A record given by per-token weights has no prompt to cut: it must fit the limits as it is."""
    for name in ("chosen", "rejected"):
        length = len(record[name])
        prompt = int(np.flatnonzero(np.asarray(record[f"{name}_weights"]) > 0)[0])
        if (max_length is not None and length > max_length) or (
            max_prompt_length is not None and prompt > max_prompt_length
        ):
            raise ValueError(
                f"{label}: the {name} sequence ({length} tokens, {prompt} before the first weighted one) exceeds "
                f"max_length={max_length} / max_prompt_length={max_prompt_length}, and a record given by per-token "
                "weights is not truncated: give prompt_length instead, or shorten it"
            )


def check_limits(max_length: Any, max_prompt_length: Any, owner: str = "") -> None:
    """``max_length`` (>= 2) and ``max_prompt_length`` (>= 1, less than ``max_length``), each an int or ``None``;
    ``owner`` starts the messages (``"DPODataModule "``).

    Example:
        >>> check_limits(8, 8)
        Traceback (most recent call last):
        ...
        ValueError: max_prompt_length=8 must be less than max_length=8, or a prompt cut to max_prompt_length leaves no room for the completion
    """
    for name, value, least in (("max_length", max_length, 2), ("max_prompt_length", max_prompt_length, 1)):
        if value is not None:
            check_int(f"{owner}{name} (or None)", value, least=least)
    if max_length is not None and max_prompt_length is not None and max_prompt_length >= max_length:
        raise ValueError(f"{owner}max_prompt_length={max_prompt_length} must be less than max_length={max_length}, or "
                         "a prompt cut to max_prompt_length leaves no room for the completion")
