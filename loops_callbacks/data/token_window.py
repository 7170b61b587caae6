"""The token ids of a long preference pair that survive the length limits, from a window of its text.

A *window* of a text is the slice of it, cut between two words, that holds every token the length
limits can keep: what a very long record is tokenized from instead of its whole text.

``max_length`` keeps the first tokens of a sequence and ``max_prompt_length`` the last tokens of
its prompt, so only the text around the start (no ``max_prompt_length``) or around the end of
the prompt (with it) can reach the datums. Tokenizing a 50 MB record whole to keep 128 tokens
costs gigabytes; ``window_token_ids`` tokenizes a window of the text instead and returns lists
that give ``preference_pairs`` *the same* pairs, limits and events as the whole text would.

The three texts of a pair (``prompt``, ``prompt + chosen``, ``prompt + rejected``, as rendered)
share a start ``shared``; their ``tails`` follow it. A window keeps the last ``before`` characters
of ``shared`` and the first ``after`` characters past its end (with ``max_prompt_length``), or
the first ``after`` characters of each text (without it), its cuts moved to fall between two
pre-tokens (words, as the tokenizer's own pre-tokenizer splits them: BPE and Unigram segment a
long word from its start, so a cut inside one would shift its tokens to its end). Tokens near a
cut may still differ from the whole text's (a BOS token added at the cut, a special token's text
cut in two): the ``_MARGIN`` tokens next to a cut are never used, and a window is accepted only
when a window about twice its size, cut elsewhere, gives the same ids; else the window doubles,
up to the whole text (then the ids are the whole text's, exactly). ``tests/data/test_token_window.py``
checks the ids against the whole text's for the shipped tokenizer and for Unigram, BPE and
WordPiece ones. A tokenizer without a pre-tokenizer (a slow one, BPE over the whole text as
Llama 2's) always tokenizes the whole text.

Examples:
    >>> from loops_callbacks.demo.hf_data import build_chat_tokenizer
    >>> tokenizer = build_chat_tokenizer()
    >>> prompt, chosen = "Say hi. " * 5000, "Hi!" + tokenizer.eos_token
    >>> ids = window_token_ids(tokenizer, prompt, ["", chosen, chosen], max_length=8, max_prompt_length=4)
    >>> ids[1] == tokenizer(prompt + chosen)["input_ids"][-len(ids[1]):], len(ids[1]) < 30
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["common_prefix_length", "cuts_between_words", "shared_start", "window_token_ids", "worth_a_window"]

_MARGIN = 16  # tokens next to a cut that are never used
_REACH = 256  # characters either side of a cut searched for a word boundary
_EDGE = 32  # word boundaries this close to the searched text's own ends are not trusted
_CHARS_PER_TOKEN = 8  # a first guess of the characters a window needs per token; windows double from there


def cuts_between_words(tokenizer: Any) -> bool:
    """Whether a window of a text may be tokenized for ``tokenizer``: a fast one with a pre-tokenizer.

    Examples:
        >>> cuts_between_words(object())  # a slow tokenizer (no backend_tokenizer)
        False
    """
    return getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None) is not None


def worth_a_window(length: int, max_length: int | None, max_prompt_length: int | None, tokenizer: Any = None) -> bool:
    """Whether a text of ``length`` characters is long enough for the limits that a window saves work.

    Never for a tokenizer without a pre-tokenizer (a slow one, or BPE over the whole text as
    Llama 2's): its cuts may change tokens far away, so it tokenizes the whole text.

    Examples:
        >>> worth_a_window(50_000_000, 128, None), worth_a_window(300, 128, None), worth_a_window(10**9, None, None)
        (True, False, False)
    """
    if max_length is None and max_prompt_length is None:
        return False
    if tokenizer is not None and not cuts_between_words(tokenizer):
        return False
    budget = (max_length or 0) + (max_prompt_length or 0) + 4 * _MARGIN
    return length > 4 * _CHARS_PER_TOKEN * budget


def window_token_ids(tokenizer: Any, shared: str, tails: Sequence[str], *, add_special_tokens: bool = True,
                     max_length: int | None = None, max_prompt_length: int | None = None) -> list[list[int]]:
    """``[prompt, prompt + chosen, prompt + rejected]`` ids, cut to what the limits can keep.

    ``tails`` are the three texts past ``shared``. The lists are slices ``ids[o:e]`` of the whole
    texts' ids, with one start ``o`` for all three, such that the completion start, the limits
    and their events come out as for the whole ids (a pair dropped because its prompt fills
    ``max_length`` is not examined past the window).
    """
    if max_length is None and max_prompt_length is None:
        raise ValueError("window_token_ids needs max_length or max_prompt_length: without limits every token is kept")
    before = _CHARS_PER_TOKEN * ((max_prompt_length or 0) + 2 * _MARGIN + 2)
    after = _CHARS_PER_TOKEN * ((max_length or 0) + 2 * _MARGIN + 2)
    if not cuts_between_words(tokenizer):
        raise ValueError(f"window_token_ids needs a tokenizer with a pre-tokenizer, not {type(tokenizer).__name__}: a "
                         "cut may change its tokens far away (worth_a_window says False for it; tokenize the whole text)")
    previous: list[list[int]] | None = None
    while True:
        lo = max(0, len(shared) - before) if max_prompt_length is not None else 0
        hi = (len(shared) if max_prompt_length is not None else 0) + after if max_length is not None else None
        lo = _word_start(tokenizer, shared, lo)
        ends = [None if hi is None else _word_end(tokenizer, shared, tail, hi) for tail in tails]
        right_cut = [end is not None and end < len(shared) + len(tail) for end, tail in zip(ends, tails)]
        texts = [_window_text(shared, tail, lo, end) for tail, end in zip(tails, ends)]
        ids = [list(i) for i in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
        if lo == 0 and not any(right_cut):
            return ids  # the whole texts
        kept = _kept(ids, lo > 0, right_cut, max_length, max_prompt_length)
        if kept is not None and kept == previous:
            return kept
        previous = kept
        before, after = 2 * before + 1, 2 * after + 1  # +1: the next window cuts a periodic text at another phase


def _word_start(tokenizer: Any, shared: str, lo: int) -> int:
    """The last cut at or before ``lo`` that falls between two pre-tokens (words), or 0: never inside a word."""
    reach = _REACH
    while lo > 0:
        start = max(0, lo - reach)
        boundaries = _boundaries(tokenizer, shared[start : lo + _REACH], start, lo)
        if boundaries:
            return max(boundaries)
        if start == 0:
            return 0
        reach *= 2
    return 0


def _word_end(tokenizer: Any, shared: str, tail: str, hi: int) -> int | None:
    """The first cut at or after ``hi`` in ``shared + tail`` between two pre-tokens, or ``None``: the whole text."""
    total, reach = len(shared) + len(tail), _REACH
    while hi < total:
        start, end = max(0, hi - _REACH), hi + reach
        boundaries = _boundaries(tokenizer, _window_text(shared, tail, start, end), start, hi, after=True)
        if boundaries:
            return min(boundaries)
        if end >= total:
            break
        reach *= 2
    return None


def _boundaries(tokenizer: Any, text: str, start: int, cut: int, *, after: bool = False) -> list[int]:
    """Where pre-tokens of ``text`` (at ``start``) begin, away from its own ends, on the ``cut``'s side."""
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    inner = [start + begin for _, (begin, _) in pieces[1:] if _EDGE <= begin <= len(text) - _EDGE]
    return [b for b in inner if (b >= cut if after else b <= cut)]


def _window_text(shared: str, tail: str, lo: int, hi: int | None) -> str:
    """``(shared + tail)[lo:hi]`` without building ``shared + tail``."""
    if hi is None:
        return shared[lo:] + tail
    if hi <= len(shared):
        return shared[lo:hi]
    return shared[lo:] + tail[: hi - len(shared)]


def _kept(ids: list[list[int]], left_cut: bool, right_cut: list[bool], max_length: int | None,
          max_prompt_length: int | None) -> list[list[int]] | None:
    """The slices of the window's ids that the limits can keep, or ``None`` when they reach tokens near a cut."""
    prompt, chosen, rejected = ids
    start = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))  # the completion start
    if max_prompt_length is not None and start > max_prompt_length + (_MARGIN if left_cut else 0):
        offset, cut = start - max_prompt_length - 1, 1  # keep one more prompt token: the prompt is still cut
    elif left_cut:
        return None  # the whole prompt may be kept: the window must hold all of it
    else:
        offset, cut = 0, 0
    ends = [len(i) for i in ids]
    if max_length is not None:  # max_length tokens past the prompt cut, and one more: the sequence is still cut
        keep = offset + cut + max_length + 1
        if right_cut[0]:  # the prompt runs past the window: only its first max_length + 1 tokens can matter
            ends = [min(end, keep) for end in ends]
        else:  # and the tokens up to where the prompt differs, for the warning that shows the prompt's end
            ends = [ends[0]] + [min(end, max(keep, start + 1)) for end in ends[1:]]
    for index, end in enumerate(ends):
        if right_cut[index] and end > len(ids[index]) - _MARGIN:
            return None
    return [i[offset:end] for i, end in zip(ids, ends)]


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share.

    Examples:
        >>> common_prefix_length([1, 2, 3], [1, 2, 4, 5]), common_prefix_length([1, 2], [1, 2, 3])
        (2, 2)
    """
    length = min(len(ids), len(other))
    differ = np.flatnonzero(np.asarray(ids[:length]) != np.asarray(other[:length]))
    return int(differ[0]) if differ.size else length


def shared_start(texts: Sequence[str]) -> int:
    """How many leading characters all ``texts`` share, compared a block at a time (no per-character loop).

    Examples:
        >>> shared_start(["<s>user: hi<a>", "<s>user: hi</s>", "<s>user: hey"])
        10
    """
    first, length = texts[0], min(len(text) for text in texts)
    start, block = 0, 4096
    while start < length:
        end = min(start + block, length)
        if all(text[start:end] == first[start:end] for text in texts[1:]):
            start, block = end, 2 * block
        elif block == 1:
            return start
        else:
            block = max(1, block // 2)
    return length
