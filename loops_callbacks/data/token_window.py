"""The token ids of a long preference pair that survive the length limits, from a window of its text.

``max_length`` keeps the first tokens of a sequence and ``max_prompt_length`` the last tokens of
its prompt, so only the text around the start (no ``max_prompt_length``) or around the end of
the prompt (with it) can reach the datums. Tokenizing a 50 MB record whole to keep 128 tokens
costs gigabytes; ``window_token_ids`` tokenizes a window of the text instead and returns lists
that give ``preference_datums`` *the same* datums, limits and events as the whole text would.

The three texts of a pair (``prompt``, ``prompt + chosen``, ``prompt + rejected``, as rendered)
share a start ``shared``; their ``tails`` follow it. A window keeps the last ``before`` characters
of ``shared`` and the first ``after`` characters past its end (with ``max_prompt_length``), or
the first ``after`` characters of each text (without it). Tokens near a cut may differ from the
whole text's (a word cut in two, a BOS token added at the cut): the ``_MARGIN`` tokens next to a
cut are never used, and a window is accepted only when the window twice its size gives the same
ids; else the window doubles, up to the whole text (then the ids are the whole text's, exactly).
So the ids are the whole text's for any tokenizer whose cuts change only nearby tokens (BPE or
WordPiece with a pre-tokenizer, SentencePiece); ``tests/test_token_window.py`` checks them against
the whole text's for the shipped tokenizer.

Example:
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

__all__ = ["common_prefix_length", "shared_start", "window_token_ids", "worth_a_window"]

_MARGIN = 16  # tokens next to a cut that are never used
_CHARS_PER_TOKEN = 8  # a first guess of the characters a window needs per token; windows double from there


def worth_a_window(length: int, max_length: int | None, max_prompt_length: int | None) -> bool:
    """Whether a text of ``length`` characters is long enough for the limits that a window saves work.

    Example:
        >>> worth_a_window(50_000_000, 128, None), worth_a_window(300, 128, None), worth_a_window(10**9, None, None)
        (True, False, False)
    """
    if max_length is None and max_prompt_length is None:
        return False
    budget = (max_length or 0) + (max_prompt_length or 0) + 4 * _MARGIN
    return length > 4 * _CHARS_PER_TOKEN * budget


def window_token_ids(
    tokenizer: Any,
    shared: str,
    tails: Sequence[str],
    *,
    add_special_tokens: bool = True,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
) -> list[list[int]]:
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
    previous: list[list[int]] | None = None
    while True:
        lo = max(0, len(shared) - before) if max_prompt_length is not None else 0
        hi = (len(shared) if max_prompt_length is not None else 0) + after if max_length is not None else None
        texts = [_window_text(shared, tail, lo, hi) for tail in tails]
        ids = [list(i) for i in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]
        right_cut = [hi is not None and hi < len(shared) + len(tail) for tail in tails]
        if lo == 0 and not any(right_cut):
            return ids  # the whole texts
        kept = _kept(ids, lo > 0, right_cut, max_length, max_prompt_length)
        if kept is not None and kept == previous:
            return kept
        previous = kept
        before, after = 2 * before, 2 * after


def _window_text(shared: str, tail: str, lo: int, hi: int | None) -> str:
    """``(shared + tail)[lo:hi]`` without building ``shared + tail``."""
    if hi is None:
        return shared[lo:] + tail
    if hi <= len(shared):
        return shared[lo:hi]
    return shared[lo:] + tail[: hi - len(shared)]


def _kept(
    ids: list[list[int]],
    left_cut: bool,
    right_cut: list[bool],
    max_length: int | None,
    max_prompt_length: int | None,
) -> list[list[int]] | None:
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

    Example:
        >>> common_prefix_length([1, 2, 3], [1, 2, 4, 5]), common_prefix_length([1, 2], [1, 2, 3])
        (2, 2)
    """
    length = min(len(ids), len(other))
    if length == 0:
        return 0
    differ = np.flatnonzero(np.asarray(ids[:length]) != np.asarray(other[:length]))
    return int(differ[0]) if differ.size else length


def shared_start(texts: Sequence[str]) -> int:
    """How many leading characters all ``texts`` share, compared a block at a time (no per-character loop).

    Example:
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
