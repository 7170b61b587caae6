"""CharTokenizer: ids, round trips, and a decode that never raises."""

from __future__ import annotations

import random

import pytest
import torch

from loops_callbacks.demo.tokenizer import DEFAULT_ALPHABET, CharTokenizer


def test_special_ids_and_vocab_size() -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(DEFAULT_ALPHABET) == 14
    assert tok.encode("0") == [3] and tok.encode("=") == [13]


def test_round_trip_on_random_strings() -> None:
    tok = CharTokenizer()
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(DEFAULT_ALPHABET) for _ in range(rng.randrange(0, 30)))
        ids = tok.encode(text)
        assert all(3 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_encode_names_the_unknown_character() -> None:
    with pytest.raises(ValueError, match=r"'x'.*'12x'"):
        CharTokenizer().encode("12x")


@pytest.mark.parametrize("alphabet", ["", "aba"])
def test_bad_alphabet_is_rejected(alphabet: str) -> None:
    with pytest.raises(ValueError, match="alphabet"):
        CharTokenizer(alphabet)


def test_decode_never_raises() -> None:
    tok = CharTokenizer()
    weird = [0, 1, 2, 3, 13, 14, 99, -1, 10**30, float("nan"), float("inf"), None, "x", torch.tensor(4)]
    assert tok.decode(weird) == "<pad><bos><eos>0=<14><99><-1><" + str(10**30) + "><nan><inf><None><x>1"
    assert tok.decode([]) == ""
    assert tok.decode(torch.tensor([1, 5, 2]).tolist()) == "<bos>2<eos>"
    rng = random.Random(1)
    for _ in range(200):
        tok.decode([rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(0, 10))])
