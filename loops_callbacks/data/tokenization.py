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

Examples:
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

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loops_callbacks import run_warnings
from loops_callbacks.data.dpo import pair_rows, prompt_rows
from loops_callbacks.data.packed_pairs import PackedPairs
from loops_callbacks.data.preference import USUAL_ROLES, parse_preference, unusual_turns
from loops_callbacks.data.sources import LocatedRecord, pair_label, read_preference_records
from loops_callbacks.data.token_window import common_prefix_length
from loops_callbacks.data.tokenizer import load_tokenizer, tokenize_preferences
from loops_callbacks.types import Datum
from loops_callbacks.validation import check_int

__all__ = ["PreferenceDataWarning", "TokenizationReport", "preference_pairs", "read_dpo_jsonl"]

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
        parts = [f"{getattr(self, event)} of {self.num_records} pair(s) {text} (first: {self.examples[event]})"
                 for event, text in _EVENTS.items() if getattr(self, event)]
        return "; ".join(parts) + "." if parts else None


_EVENTS = {  # what the warning says of each event counted in a TokenizationReport
    "prompt_not_prefix": "have a tokenized prompt that is not a prefix of the tokenized prompt+completion, "
                         "usually because the chat template renders the prompt alone differently or because tokens "
                         "merge across the boundary; their completion starts where the two diverge, and the rest of "
                         "the prompt is left out of the training sequence, so the model is trained on a context that "
                         "differs from the one it sees at inference: use a chat template that renders the prompt the "
                         "same way in both cases, or end the prompt on a token boundary",
    "prompt_truncated": "had their prompt cut to its last max_prompt_length tokens",
    "truncated": "had a sequence cut to its first max_length tokens",
    "dropped_prompt_fills_max_length": "were dropped: their prompt alone fills max_length",
    "dropped_empty_completion": "were dropped: no completion token left in the chosen or rejected sequence",
    "identical": "have the same chosen and rejected sequence, so they give no gradient and only cost compute: remove them",
    "unusual_role": f"have a message role outside {sorted(USUAL_ROLES)}, which the chat template renders as is: check "
                    "for a typo",
    "completion_not_assistant": "have a chosen or rejected completion that does not start with an assistant turn, so "
                                "that turn's role header is trained as completion",
}


def apply_length_limits(chosen: list[int], rejected: list[int], prompt_length: int, *, max_length: int | None = None,
                        max_prompt_length: int | None = None) -> tuple[list[int], list[int], int, list[str]]:
    """The pair within the limits, and what happened (events of ``TokenizationReport``; a ``dropped_*`` one means drop it).

    ``max_prompt_length`` keeps the last tokens of a longer prompt; then ``max_length`` keeps the
    first tokens of a longer sequence, and a prompt that fills it drops the pair.

    Examples:
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


def preference_pairs(source: Any, tokenizer: Any = None, *, max_length: int | None = None,
                     max_prompt_length: int | None = None, progress: bool = True, warn: bool = True
                     ) -> tuple[PackedPairs, TokenizationReport]:
    """Interleaved DPO pairs (chosen at even indices, rejected at odd) from preference records, packed:
    each sequence's ids, targets and weights go straight into flat arrays (no datum is made).

    Args:
        source: anything ``read_preference_records`` reads (a file path, a list of records, a
            ``datasets.Dataset``, ``load_dataset`` arguments), or the records it read.
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
    is_read = isinstance(source, list) and bool(source) and isinstance(source[0], LocatedRecord)
    pairs, report = tokenize_records(source if is_read else read_preference_records(source), tokenizer,
                                     max_length=max_length, max_prompt_length=max_prompt_length, progress=progress)
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
        chosen, rejected, prompt_length, events = apply_length_limits(chosen, rejected, prompt_length,
                                                                      max_length=max_length,
                                                                      max_prompt_length=max_prompt_length)
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
        if length > (max_length or length) or prompt > (max_prompt_length or prompt):
            raise ValueError(f"{label}: the {name} sequence ({length} tokens, {prompt} before the first weighted one) "
                             f"exceeds max_length={max_length} / max_prompt_length={max_prompt_length}, and a record "
                             "given by per-token weights is not truncated: give prompt_length instead, or shorten it")


def check_limits(max_length: Any, max_prompt_length: Any, owner: str = "") -> None:
    """``max_length`` (>= 2) and ``max_prompt_length`` (>= 1, less than ``max_length``), each an int or ``None``;
    ``owner`` starts the messages (``"DPODataModule "``).

    Examples:
        >>> check_limits(8, 8)
        Traceback (most recent call last):
        ...
        ValueError: max_prompt_length=8 must be less than max_length=8, or a prompt cut to max_prompt_length leaves no room for the completion
    """
    check_int(f"{owner}max_length", max_length, least=2, optional=True)
    check_int(f"{owner}max_prompt_length", max_prompt_length, least=1, optional=True)
    if max_length is not None and max_prompt_length is not None and max_prompt_length >= max_length:
        raise ValueError(f"{owner}max_prompt_length={max_prompt_length} must be less than max_length={max_length}, or "
                         "a prompt cut to max_prompt_length leaves no room for the completion")
