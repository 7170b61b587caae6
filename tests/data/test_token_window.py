"""A long record tokenized from a window of its text gives the same datums as its whole text.

Property tests on the shipped tokenizer (``configs/data/chat_tokenizer``, byte-level BPE, ChatML):
standard, conversational and implicit records, texts made of awkward pieces (spaces and
newlines at the cut, multi-byte UTF-8, special-token text, digits), cut by ``max_length`` and
``max_prompt_length``; the whole-text path is the reference (windows switched off).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loops_callbacks.data import tokenizer as tokenizing  # noqa: E402
from tests.data.test_preference_data import preference_datums  # noqa: E402
from loops_callbacks.data.token_window import shared_start, window_token_ids, worth_a_window  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = transformers.AutoTokenizer.from_pretrained(str(ROOT / "configs" / "data" / "chat_tokenizer"))

PIECES = [
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "a",
    "word",
    " word",
    "é",
    "日本語",
    "🙂",
    "👩‍👩‍👧",
    "<|im_end|>",
    "<|im_",
    "123",
    "4",
    ".",
    "!?",
    "'s",
    " '",
    "x" * 40,
    "ÿ",
]
text = st.lists(st.sampled_from(PIECES), min_size=1, max_size=30).map("".join)


def long_text(draw: Any, minimum: int) -> str:
    """A text of at least ``minimum`` characters: drawn pieces, a drawn body repeated, drawn pieces."""
    head, body, tail = draw(text), draw(text), draw(text)
    return head + body * (minimum // len(body) + 1) + tail


@st.composite
def records(draw: Any) -> dict[str, Any]:
    fmt = draw(st.sampled_from(["standard", "conversational", "implicit_standard", "implicit_conversational"]))
    long_prompt, long_completion = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    prompt = long_text(draw, 3000) if long_prompt else draw(text)
    chosen = long_text(draw, 3000) if long_completion else draw(text)
    rejected = draw(st.one_of(st.just(chosen), text, st.builds(lambda t: chosen[: len(chosen) // 2] + t, text)))
    if fmt == "standard":
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if fmt == "implicit_standard":
        return {"chosen": prompt + chosen, "rejected": prompt + rejected}
    turns = [{"role": "user", "content": prompt}]
    if draw(st.booleans()):
        turns = [{"role": "system", "content": draw(text)}, *turns]
    answer = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
    if fmt == "conversational":
        return {"prompt": turns, "chosen": answer[0], "rejected": answer[1]}
    return {"chosen": turns + answer[0], "rejected": turns + answer[1]}


limits = st.sampled_from([(16, None), (128, None), (None, 8), (24, 8), (128, 64), (40, 39), (2, 1)])


def datums_and_report(record: dict[str, Any], max_length: int | None, max_prompt_length: int | None) -> Any:
    try:
        data, report = preference_datums(
            [record], TOKENIZER, max_length=max_length, max_prompt_length=max_prompt_length, progress=False, warn=False
        )
    except ValueError as error:
        return str(error)
    rows = [(d.model_input.to_ints(), d.loss_fn_inputs["weights"].data) for d in data]
    events = {k: v for k, v in vars(report).items() if k not in ("examples",)}
    return rows, events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(record=records(), limit=limits)
def test_a_window_gives_the_whole_texts_datums(
    record: dict[str, Any], limit: tuple[Any, Any], monkeypatch_module: pytest.MonkeyPatch
) -> None:
    max_length, max_prompt_length = limit
    with monkeypatch_module.context() as patch:  # a window for every record, long or short
        patch.setattr(tokenizing, "worth_a_window", lambda *args: True)
        windowed = datums_and_report(record, max_length, max_prompt_length)
    with monkeypatch_module.context() as patch:
        patch.setattr(tokenizing, "worth_a_window", lambda *args: False)
        whole = datums_and_report(record, max_length, max_prompt_length)
    assert windowed == whole


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@settings(max_examples=80, deadline=None)
@given(prompt=text, chosen=text, rejected=text, repeat=st.integers(50, 400), cut=st.integers(0, 40), limit=limits)
def test_window_ids_are_slices_of_the_whole_ids(
    prompt: str, chosen: str, rejected: str, repeat: int, cut: int, limit: tuple[Any, Any]
) -> None:
    """Cut anywhere in a repeated text (inside a multi-byte character's neighbours, a word, a special token)."""
    max_length, max_prompt_length = limit
    shared = (prompt * repeat)[cut:]
    tails = ["", chosen + TOKENIZER.eos_token, rejected + TOKENIZER.eos_token]
    whole = [TOKENIZER(shared + tail)["input_ids"] for tail in tails]
    got = window_token_ids(TOKENIZER, shared, tails, max_length=max_length, max_prompt_length=max_prompt_length)
    for part, full in zip(got, whole):
        starts = [k for k in range(len(full) - len(part) + 1) if full[k : k + len(part)] == part]
        assert starts, (part, full)


def test_a_long_record_is_tokenized_from_a_window() -> None:
    calls: list[int] = []
    real = TOKENIZER.__class__.__call__

    class Counting(TOKENIZER.__class__):  # type: ignore[misc,name-defined]
        def __call__(self, texts: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(max(len(t) for t in ([texts] if isinstance(texts, str) else texts)))
            return real(self, texts, *args, **kwargs)

    tokenizer = Counting.from_pretrained(str(ROOT / "configs" / "data" / "chat_tokenizer"))
    record = {"prompt": "Tell me a story. " * 200_000, "chosen": " Once.", "rejected": " No."}
    assert worth_a_window(len(record["prompt"]), 128, None)
    data, report = preference_datums(
        [record], tokenizer, max_length=128, max_prompt_length=64, progress=False, warn=False
    )
    assert report.prompt_truncated == 1 and len(data[0].model_input.to_ints()) <= 128
    assert calls and max(calls) < 20_000 < len(record["prompt"])  # never the whole text


def test_shared_start_finds_the_first_difference_anywhere() -> None:
    base = "é" * 10_000
    for at in (0, 1, 4095, 4096, 4097, 9_999):
        other = base[:at] + "x" + base[at + 1 :]
        assert shared_start([base, other, base]) == at
    assert shared_start([base, base + "y"]) == len(base)


PEAK_CHILD = r"""
import resource, sys
from loops_callbacks.data.tokenization import preference_pairs
text = "The quick brown fox jumps over the lazy dog 1234 times, naïvely. " * 60_000  # 4 MB
record = {"prompt": "Write a long story.", "chosen": " " + text, "rejected": " No."}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
preference_pairs([record], sys.argv[1], max_length=128, progress=False, warn=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_the_peak_memory_of_a_long_record_is_bounded_by_the_limits() -> None:
    """4 MB of text with max_length=128: the whole text would take ~900 MB of peak RSS; a window a few."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(ROOT / "configs" / "data" / "chat_tokenizer")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 64  # MB of peak RSS growth


def test_a_tokenizer_without_a_pre_tokenizer_tokenizes_the_whole_text() -> None:
    """BPE over the whole text (no pre-tokenizer) or a slow tokenizer: a cut may move tokens far away."""

    class Backend:
        pre_tokenizer = None

    class WholeText:
        backend_tokenizer = Backend()

    assert worth_a_window(50_000_000, 128, None, TOKENIZER)
    assert not worth_a_window(50_000_000, 128, None, WholeText())
    assert not worth_a_window(50_000_000, 128, None, object())  # a slow tokenizer has no backend


def other_tokenizer(kind: str) -> Any:
    """A small tokenizer of another family, trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    special = ["<unk>", "</s>"]
    if kind == "unigram_metaspace":
        backend = Tokenizer(models.Unigram())
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer: Any = trainers.UnigramTrainer(vocab_size=200, special_tokens=special, unk_token="<unk>")
    elif kind == "bpe_metaspace":
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special)
    else:
        backend = Tokenizer(models.WordPiece(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=special)
    corpus = [
        "the quick brown fox jumps over the lazy dog " * 3,
        "naïve café 日本語 🙂 1234",
        "aaaa bbbb aaaabbbb abab",
    ] * 50
    backend.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


OTHER_PIECES = [" ", "the", " quick", "aaaa", "bb", "é", "日本", "🙂", "\n", "12", "ab", "  "]
other_text = st.lists(st.sampled_from(OTHER_PIECES), min_size=1, max_size=12).map("".join)


@pytest.mark.parametrize("kind", ["unigram_metaspace", "bpe_metaspace", "wordpiece"])
def test_window_ids_are_the_whole_texts_for_other_tokenizer_families(kind: str) -> None:
    tokenizer = other_tokenizer(kind)

    @settings(max_examples=60, deadline=None)
    @given(
        body=other_text,
        repeat=st.integers(100, 600),
        cut=st.integers(0, 20),
        chosen=other_text,
        rejected=st.lists(st.sampled_from(OTHER_PIECES), max_size=400).map("".join),
        limit=limits,
    )
    def check(body: str, repeat: int, cut: int, chosen: str, rejected: str, limit: tuple[Any, Any]) -> None:
        shared = (body * repeat)[cut:]
        tails = ["", chosen + "</s>", rejected + "</s>"]
        whole = [tokenizer(shared + tail)["input_ids"] for tail in tails]
        got = window_token_ids(tokenizer, shared, tails, max_length=limit[0], max_prompt_length=limit[1])
        for part, full in zip(got, whole):
            assert any(full[k : k + len(part)] == part for k in range(len(full) - len(part) + 1))

    check()


@pytest.mark.parametrize("kind", ["unigram_metaspace", "bpe_metaspace"])
def test_a_window_is_cut_between_words_never_inside_a_long_one(kind: str) -> None:
    """Thousands of letters without a space are one pre-token: BPE and Unigram segment it from its start,
    so a cut inside it shifts its tokens all the way to its end; the window is cut between pre-tokens."""
    tokenizer = other_tokenizer(kind)
    tails = ["", "日本bb</s>", "bb quick🙂 quick日本\né" * 20 + "</s>"]
    for length in range(1850, 1900):
        shared = "a" * length
        whole = [tokenizer(shared + tail)["input_ids"] for tail in tails]
        for max_length, max_prompt_length in ((24, 8), (None, 8), (64, 32)):
            got = window_token_ids(tokenizer, shared, tails, max_length=max_length, max_prompt_length=max_prompt_length)
            for part, full in zip(got, whole):
                assert any(full[k : k + len(part)] == part for k in range(len(full) - len(part) + 1)), (length, part)


def test_a_window_of_a_tokenizer_without_a_pre_tokenizer_is_refused_not_silently_whole() -> None:
    class Backend:
        pre_tokenizer = None

    class WholeText:
        backend_tokenizer = Backend()

        def __call__(self, text: Any, **kwargs: Any) -> Any:
            raise AssertionError("window_token_ids must not tokenize for a tokenizer it cannot cut")

    with pytest.raises(ValueError, match="needs a tokenizer with a pre-tokenizer, not WholeText"):
        window_token_ids(WholeText(), "a" * 100, ["", "b", "c"], max_length=8)
