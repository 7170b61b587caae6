"""How a preference pair, a datum and a place in a file are named in every error and warning.

One wording everywhere, so a message can be searched for: ``pair 3 (line 8 of pairs.jsonl)``,
``pair 1: the rejected datum (index 3)``.

Example:
    >>> pair_label(3, file_line(8, "pairs.jsonl"))
    'pair 3 (line 8 of pairs.jsonl)'
    >>> datum_label(3), datum_label(2, file_line(8, "pairs.jsonl"))
    ('pair 1: the rejected datum (index 3)', 'pair 1 (line 8 of pairs.jsonl): the chosen datum (index 2)')
"""

from __future__ import annotations

import os

__all__ = ["datum_label", "file_line", "pair_label"]


def pair_label(pair: int, where: str | None = None) -> str:
    """``pair p``, with where it came from in parentheses when known."""
    return f"pair {pair} ({where})" if where else f"pair {pair}"


def file_line(number: int, path: str | os.PathLike[str]) -> str:
    """``line n of path`` (1-based line numbers, as editors count)."""
    return f"line {number} of {os.fspath(path)}"


def datum_label(index: int, where: str | None = None) -> str:
    """Datum ``index`` of interleaved pairs (chosen at even indices, rejected at odd), and where its pair was read."""
    return f"{pair_label(index // 2, where)}: the {'rejected' if index % 2 else 'chosen'} datum (index {index})"
