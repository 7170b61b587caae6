"""A small character-level tokenizer for the demo tasks.

Why characters and not bytes: a byte-level vocabulary has 256+ tokens, so a randomly initialised
policy puts about 1/259 of its probability on the right digit, almost every sampled completion
scores 0, and most GRPO groups carry no learning signal. With one token per character of a small
alphabet (digits and ``=``, plus three special tokens) the starting policy is right about one time
in fourteen per character, and a tiny model learns the demo task by RL in about a minute on a
laptop CPU.

Ids: ``pad_id = 0`` (the padding value of every demo batch), ``bos_id = 1``, ``eos_id = 2``, then
one id per alphabet character in order.

Examples:
    >>> tok = CharTokenizer()
    >>> ids = tok.encode("12=")
    >>> ids, tok.vocab_size
    ([4, 5, 13], 14)
    >>> tok.decode([tok.bos_id, *ids, tok.eos_id, 99])
    '<bos>12=<eos><99>'
"""

from __future__ import annotations

DEFAULT_ALPHABET = "0123456789="

_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """One token per character of ``alphabet``, after the special tokens ``<pad>``, ``<bos>``, ``<eos>``.

    Args:
        alphabet: the characters the tokenizer knows, each once, in id order.

    ``encode`` raises ``ValueError`` on a character outside the alphabet; ``decode`` never raises:
    special ids render as ``<pad>``, ``<bos>``, ``<eos>`` and any other unknown id as ``<id>``.

    Examples:
        >>> tok = CharTokenizer("ab")
        >>> tok.decode(tok.encode("abba")), tok.vocab_size
        ('abba', 5)
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not alphabet:
            raise ValueError("CharTokenizer alphabet is empty; pass at least one character")
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if repeated:
            raise ValueError(f"CharTokenizer alphabet {alphabet!r} repeats the characters {repeated}")
        self.alphabet = alphabet
        self._char_to_id = {c: i + len(_SPECIAL_TOKENS) for i, c in enumerate(alphabet)}
        self._id_to_text = {**dict(enumerate(_SPECIAL_TOKENS)), **{i: c for c, i in self._char_to_id.items()}}
        self.vocab_size = len(_SPECIAL_TOKENS) + len(alphabet)  # the special tokens, then one per character

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, one per character (no BOS/EOS added)."""
        try:
            return [self._char_to_id[c] for c in text]
        except KeyError as error:
            raise ValueError(f"CharTokenizer cannot encode character {error.args[0]!r} of {text!r}; "
                             f"its alphabet is {self.alphabet!r}") from None

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``; never raises (unknown ids render as ``<id>``)."""
        return "".join(self._token_text(i) for i in token_ids)

    def _token_text(self, token: object) -> str:
        try:
            index = int(token)  # type: ignore[call-overload]
        except (TypeError, ValueError, OverflowError):
            return f"<{token}>"
        return self._id_to_text.get(index, f"<{index}>")

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r})"
