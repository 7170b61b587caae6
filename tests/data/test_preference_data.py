"""Preference records: every format from every source, format errors that say where, TRL-style tokenization, limits.

The tokenizer is the shipped chat tokenizer (``configs/data/chat_tokenizer``, byte-level BPE with a
ChatML template that starts with BOS); nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
parquet = pytest.importorskip("pyarrow.parquet")
import pyarrow  # noqa: E402

from loops_callbacks.data.preference import parse_preference  # noqa: E402
from loops_callbacks.data.sources import read_preference_records  # noqa: E402
from loops_callbacks.data.tokenization import (  # noqa: E402
    PreferenceDataWarning,
    apply_length_limits,
    preference_pairs,
)
from loops_callbacks.data.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_PATH = str(ROOT / "configs" / "data" / "chat_tokenizer")


def preference_datums(source: Any, tokenizer: Any = None, **kwargs: Any) -> tuple[list[Any], Any]:
    """``preference_pairs``' pairs as datums (the SDK's boundary), and its report."""
    pairs, report = preference_pairs(source, tokenizer, **kwargs)
    return pairs.datums(), report


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_dataset`` writes its Arrow cache under the test's tmp dir, nowhere else."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_PATH)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}

RECORDS: dict[str, list[dict[str, Any]]] = {
    "standard": [
        {"prompt": "What is 2 plus 2?", "chosen": " 4.", "rejected": " 5."},
        {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " No.", "score": 3},
    ],
    "conversational": [
        {"prompt": [SYSTEM, user("What is 2 plus 2?")], "chosen": [assistant("4.")], "rejected": [assistant("5.")]},
        {
            "prompt": [user("Hi")],
            "chosen": [assistant("Hello!"), user("Thanks"), assistant("Any time.")],  # several turns
            "rejected": [assistant("Go away.")],
        },
    ],
    "implicit_standard": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Snow is white.", "rejected": "Snow is cold."},
    ],
    "implicit_conversational": [
        {
            "chosen": [user("What colour is snow?"), assistant("White.")],
            "rejected": [user("What colour is snow?"), assistant("Purple.")],
        },
        {
            "chosen": [SYSTEM, user("Opposite of hot?"), assistant("Cold.")],
            "rejected": [SYSTEM, user("Opposite of hot?"), assistant("I don't know.")],
        },
    ],
    "token_ids": [
        {"chosen": [1, 5, 6, 7], "rejected": [1, 5, 8], "prompt_length": 2},
        {"chosen": [1, 9, 10], "rejected": [1, 9, 11, 12], "prompt_length": 2},
    ],
}


def sequences(data: list[Any]) -> list[tuple[list[int], list[float]]]:
    return [(d.model_input.to_ints(), d.loss_fn_inputs["weights"].data) for d in data]


def prompt_length(datum: Any) -> int:
    weights = datum.loss_fn_inputs["weights"].data
    return next(k for k, w in enumerate(weights) if w > 0) + 1


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", sorted(RECORDS))
def test_each_format_is_detected(fmt: str) -> None:
    assert {parse_preference(record, "item").format for record in RECORDS[fmt]} == {fmt}


def test_implicit_prompts_are_extracted_as_trl_does() -> None:
    text = parse_preference(RECORDS["implicit_standard"][0], "item 0")
    assert (text.prompt, text.chosen, text.rejected) == ("The sky is", " blue.", " green.")  # the space moves
    chat = parse_preference(RECORDS["implicit_conversational"][1], "item 1")
    assert chat.prompt == [SYSTEM, user("Opposite of hot?")] and chat.chosen == [assistant("Cold.")]
    # a string prompt beside full conversations is implicit (TRL's maybe_extract_prompt)
    record = {"prompt": "What colour is snow?", **RECORDS["implicit_conversational"][0]}
    assert parse_preference(record, "x").format == "implicit_conversational"
    # one a prefix of the other: the last shared element stays in the completions, neither is empty
    prefix = parse_preference({"chosen": "abc", "rejected": "abcd"}, "x")
    assert (prefix.prompt, prefix.chosen, prefix.rejected) == ("ab", "c", "cd")
    # a difference at the first character: an empty prompt (TRL would look at the last character)
    first = parse_preference({"chosen": "yes ", "rejected": "no"}, "x")
    assert (first.prompt, first.chosen) == ("", "yes ")
    # Arrow fills missing columns with None: absent
    assert parse_preference({"prompt": None, "chosen": "a b", "rejected": "a c"}, "x").format == "implicit_standard"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "p", "chosen": "c"}, r"item 3: the record has no 'rejected'.*keys: \['chosen', 'prompt'\]"),
        ({"question": "p", "answer": "c"}, r"no 'chosen' or 'rejected'.*keys: \['answer', 'question'\]"),
        ({"prompt": "p", "chosen": "c", "rejected": [assistant("r")]}, r"fits no preference format: 'chosen' is a string"),
        ({"prompt": [user("p")], "chosen": "c", "rejected": "r"}, r"'prompt' is a list of dicts.*standard record"),
        ({"prompt": 5, "chosen": [assistant("c")], "rejected": [assistant("r")]}, r"'prompt' is an int"),
        ({"prompt": "p", "chosen": [], "rejected": []}, r"'chosen' is an empty list"),
        ({"chosen": [{"content": "c"}], "rejected": [{"content": "r"}]}, r"list of dicts with keys \['content'\]"),
        ({"chosen": [{"role": 1, "content": "c"}], "rejected": [assistant("r")]}, r"chosen\[0\] has role 1"),
        ({"chosen": [user("x"), {"role": None}], "rejected": [user("x")]}, r"chosen\[1\] has role None"),
        ({"chosen": "", "rejected": "abc"}, r"needs non-empty 'chosen' and 'rejected'"),
        (["chosen", "rejected"], r"must be a JSON object / dict, got list"),
    ],
)
def test_a_record_that_fits_no_format_is_named(record: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_preference(record, "item 3")


# ----------------------------------------------------------------------------- sources


def write_source(kind: str, records: list[dict[str, Any]], directory: Path) -> Any:
    """``records`` as source ``kind``: a file path, a Dataset, load_dataset arguments or the list itself."""
    if kind == "list":
        return records
    if kind == "jsonl":
        path = directory / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)
    if kind == "json":
        path = directory / "pairs.json"
        path.write_text(json.dumps(records, indent=2))
        return str(path)
    if kind == "json_lines_in_json":
        path = directory / "lines.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)
    if kind == "parquet":
        path = directory / "pairs.parquet"
        parquet.write_table(pyarrow.Table.from_pylist(records), path)
        return str(path)
    if kind == "dataset":
        return datasets.Dataset.from_list(records)
    if kind == "dataset_dict_split":
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(records)})["train"]
    if kind == "load_dataset":
        path = directory / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return {"path": "json", "data_files": str(path), "split": "train"}
    raise AssertionError(kind)


SOURCES = ["list", "jsonl", "json", "json_lines_in_json", "parquet", "dataset", "dataset_dict_split", "load_dataset"]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("fmt", sorted(RECORDS))
def test_every_format_from_every_source_gives_the_same_datums(
    fmt: str, source: str, tokenizer: Any, tmp_path: Path
) -> None:
    records = RECORDS[fmt]
    expected, _ = preference_datums(copy.deepcopy(records), tokenizer, progress=False)
    data, report = preference_datums(write_source(source, records, tmp_path), tokenizer, progress=False)
    assert sequences(data) == sequences(expected)
    assert report.formats == {fmt: len(records)} and report.num_pairs == len(records)


@pytest.mark.parametrize(
    ("source", "where"),
    [
        ("list", "item 1 of the data list"),
        ("jsonl", "line 2 of {dir}/pairs.jsonl"),
        ("json", "item 1 of {dir}/pairs.json"),
        ("parquet", "row 1 of {dir}/pairs.parquet"),
        ("dataset", "row 1 of the dataset"),
        ("load_dataset", "row 1 of json split 'train'"),
    ],
)
def test_errors_name_the_file_and_line_or_row(source: str, where: str, tokenizer: Any, tmp_path: Path) -> None:
    records = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a", "rejected": None}]
    with pytest.raises(ValueError, match=re.escape(where.format(dir=tmp_path) + ": the record has no 'rejected'")):
        preference_datums(write_source(source, records, tmp_path), tokenizer, progress=False)


def test_bad_sources_are_explained(tmp_path: Path) -> None:
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"chosen": "a", "rejected": "b"}\n\n{not json\n')
    with pytest.raises(ValueError, match=re.escape(f"pair 1 (line 3 of {bad}): not valid JSON")):
        read_preference_records(str(bad))
    with pytest.raises(ValueError, match="unknown preference file type; use .jsonl, .json or .parquet"):
        read_preference_records(str(tmp_path / "pairs.csv"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_preference_records(str(tmp_path / "missing.parquet"))
    with pytest.raises(ValueError, match=r"several splits \(\['test', 'train'\]\); pass one, e.g. dataset\['train'\]"):
        read_preference_records(
            datasets.DatasetDict({"train": datasets.Dataset.from_list([{"a": 1}]), "test": datasets.Dataset.from_list([{"a": 1}])})
        )
    with pytest.raises(ValueError, match="load_dataset arguments need 'path'"):
        read_preference_records({"data_files": "x.jsonl"})
    with pytest.raises(ValueError, match=r"unknown load_dataset argument\(s\) \['streaming'\]"):
        read_preference_records({"path": "json", "streaming": True})
    with pytest.raises(TypeError, match="got int"):  # a wrong type is a TypeError
        read_preference_records(5)


def test_jsonl_lines_end_at_newline_only(tmp_path: Path) -> None:
    # JSON strings may hold U+2028 and U+0085 unescaped (json.dumps(..., ensure_ascii=False) writes them)
    records = [{"prompt": "a\u2028b", "chosen": "c\x85", "rejected": "d"}, {"prompt": "p", "chosen": "a", "rejected": "b"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    located = read_preference_records(str(path))
    assert [r.record for r in located] == records
    assert [r.where for r in located] == [f"line 1 of {path}", f"line 2 of {path}"]


def test_load_dataset_without_a_split_uses_the_only_one(tmp_path: Path) -> None:
    source = write_source("load_dataset", RECORDS["standard"], tmp_path)
    del source["split"]
    located = read_preference_records(source)
    assert [r.where for r in located] == ["row 0 of json split 'train'", "row 1 of json split 'train'"]


# ----------------------------------------------------------------------------- tokenization


def test_standard_records_are_tokenized_with_eos_as_trl_does(tokenizer: Any) -> None:
    records = [
        {"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5" + tokenizer.eos_token},  # EOS only where it lacks
    ]
    [chosen, rejected], _ = preference_datums(records, tokenizer, progress=False)
    prompt = tokenizer("Q: 2+2?")["input_ids"]
    assert chosen.model_input.to_ints() == tokenizer("Q: 2+2? 4" + tokenizer.eos_token)["input_ids"]
    assert rejected.model_input.to_ints() == tokenizer("Q: 2+2? 5" + tokenizer.eos_token)["input_ids"]
    assert chosen.model_input.to_ints()[0] == tokenizer.bos_token_id
    assert prompt_length(chosen) == prompt_length(rejected) == len(prompt)
    # Loops convention: position k predicts token k + 1; the last position predicts nothing
    assert chosen.loss_fn_inputs["target_tokens"].data == [*chosen.model_input.to_ints()[1:], 0]
    assert chosen.loss_fn_inputs["weights"].data[-1] == 0.0


def test_conversational_records_use_the_chat_template_and_its_generation_prompt(tokenizer: Any) -> None:
    record = RECORDS["conversational"][1]
    [chosen, rejected], _ = preference_datums([record], tokenizer, progress=False)
    prompt = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True)["input_ids"]
    full = tokenizer.apply_chat_template(record["prompt"] + record["chosen"])["input_ids"]
    assert chosen.model_input.to_ints() == full and prompt_length(chosen) == len(prompt)
    assert full.count(tokenizer.bos_token_id) == 1  # the template's BOS, none added on top
    text = tokenizer.decode(chosen.model_input.to_ints()[len(prompt) :])
    assert text == "Hello!<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\nAny time.<|im_end|>\n"
    assert tokenizer.decode(rejected.model_input.to_ints()[len(prompt) :]) == "Go away.<|im_end|>\n"


def test_tools_and_chat_template_kwargs_reach_the_template(tokenizer: Any) -> None:
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = (
        "{% if tools %}{{ 'tools: ' + tools | map(attribute='name') | join(',') + '\n' }}{% endif %}"
        "{% if formal %}{{ 'Dear assistant,\n' }}{% endif %}" + tokenizer.chat_template
    )
    plain = {"prompt": [user("Hi")], "chosen": [assistant("Hello")], "rejected": [assistant("No")]}
    with_extras = {**plain, "tools": json.dumps([{"name": "calc"}]), "chat_template_kwargs": {"formal": True}}
    data, _ = preference_datums([plain, with_extras], templated, progress=False)
    assert templated.decode(data[0].model_input.to_ints()).startswith("<|begin_of_text|><|im_start|>user")
    assert templated.decode(data[2].model_input.to_ints()).startswith("tools: calc\nDear assistant,\n<|begin_of_text|>")


def test_a_chat_template_that_renders_the_prompt_differently_splits_where_they_diverge(tokenizer: Any) -> None:
    thinking = copy.deepcopy(tokenizer)  # like Gemma's: the prompt alone ends with an empty thought block
    thinking.chat_template = tokenizer.chat_template.replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think></think>'"
    )
    record = RECORDS["conversational"][0]
    with pytest.warns(PreferenceDataWarning, match=r"1 of 1 pair\(s\) have a tokenized prompt that is not a prefix.*'<think></think>'"):
        [chosen, _], report = preference_datums([record], thinking, progress=False)
    full = thinking.apply_chat_template(record["prompt"] + record["chosen"])["input_ids"]
    before = thinking.apply_chat_template(record["prompt"])["input_ids"]  # no generation prompt
    assert chosen.model_input.to_ints() == full and report.prompt_not_prefix == 1
    assert prompt_length(chosen) == len(before) + len(thinking("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])


def test_the_tokenizer_may_be_a_name_or_path_and_is_needed_for_text(tokenizer: Any) -> None:
    by_path, _ = preference_datums(RECORDS["conversational"], TOKENIZER_PATH, progress=False)
    by_object, _ = preference_datums(RECORDS["conversational"], tokenizer, progress=False)
    assert sequences(by_path) == sequences(by_object)
    with pytest.raises(ValueError, match="item 0 of the data list: standard records are text and need a tokenizer"):
        preference_datums(RECORDS["standard"], None, progress=False)
    preference_datums(RECORDS["token_ids"], None, progress=False)  # token ids need none
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="item 0 of the data list: a conversational record needs a tokenizer with a chat template"):
        preference_datums(RECORDS["conversational"], no_template, progress=False)
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
        load_tokenizer(42)


def test_the_callers_records_are_not_modified(tokenizer: Any) -> None:
    records = copy.deepcopy([*RECORDS["standard"], *RECORDS["conversational"]])
    before = copy.deepcopy(records)
    with pytest.warns(PreferenceDataWarning):
        preference_datums(records, tokenizer, max_length=20, max_prompt_length=8, progress=False)
    assert records == before


# ----------------------------------------------------------------------------- limits


def test_max_length_keeps_the_start_and_drops_pairs_whose_prompt_fills_it(tokenizer: Any) -> None:
    records = RECORDS["conversational"]
    full, _ = preference_datums(records, tokenizer, progress=False)
    lengths = [len(d.model_input.to_ints()) for d in full]
    prompts = [prompt_length(d) for d in full[::2]]
    limit = prompts[0] + 2  # pair 0 keeps two completion tokens; pair 1 (shorter prompt) more
    assert all(max(lengths[2 * pair : 2 * pair + 2]) > limit for pair in (0, 1))
    with pytest.warns(PreferenceDataWarning) as caught:
        data, report = preference_datums(records, tokenizer, max_length=limit, progress=False)
    assert len(caught) == 1  # one warning for everything, never one per pair
    assert str(caught[0].message) == (
        "2 of 2 pair(s) had a sequence cut to its first max_length tokens (first: item 0 of the data list)."
    )
    assert report.truncated == 2 and report.num_pairs == 2
    for short, long in zip(data, full):
        assert short.model_input.to_ints() == long.model_input.to_ints()[:limit]
        assert prompt_length(short) == prompt_length(long)
    with pytest.warns(PreferenceDataWarning, match=r"1 of 2 pair\(s\) were dropped: their prompt alone fills max_length \(first: item 0"):
        data, report = preference_datums(records, tokenizer, max_length=prompts[0], progress=False)
    assert report.dropped_prompt_fills_max_length == 1 and report.record_indices == [1]
    with pytest.raises(ValueError, match=r"no preference pair left out of 2 record\(s\).*prompt alone fills max_length"):
        preference_datums(records, tokenizer, max_length=3, progress=False)


def test_max_prompt_length_keeps_the_end_of_the_prompt_and_the_whole_completion(tokenizer: Any) -> None:
    records = RECORDS["conversational"]
    full, _ = preference_datums(records, tokenizer, progress=False)
    with pytest.warns(PreferenceDataWarning, match=r"2 of 2 pair\(s\) had their prompt cut to its last max_prompt_length"):
        data, report = preference_datums(records, tokenizer, max_prompt_length=5, progress=False)
    assert report.prompt_truncated == 2
    for short, long in zip(data, full):
        cut = prompt_length(long) - 5
        assert short.model_input.to_ints() == long.model_input.to_ints()[cut:] and prompt_length(short) == 5
    # both limits: the prompt's end, then the sequence's start
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both, report = preference_datums(records, tokenizer, max_prompt_length=5, max_length=7, progress=False)
    assert len(caught) == 1 and report.prompt_truncated == 2 and report.truncated == 2
    assert all(len(d.model_input.to_ints()) == 7 and prompt_length(d) == 5 for d in both)
    with pytest.raises(ValueError, match="max_prompt_length=7 must be less than max_length=7"):
        preference_datums(records, tokenizer, max_prompt_length=7, max_length=7, progress=False)
    with pytest.raises(ValueError, match=r"max_length must be an int >= 2 or None, got 1"):
        preference_datums(records, tokenizer, max_length=1, progress=False)


def test_limits_apply_to_token_id_records_too() -> None:
    records = [{"chosen": [1, 2, 3, 4, 5, 6], "rejected": [1, 2, 3, 7], "prompt_length": 3}]
    with pytest.warns(PreferenceDataWarning):
        [chosen, rejected], report = preference_datums(records, max_prompt_length=2, max_length=4, progress=False)
    assert chosen.model_input.to_ints() == [2, 3, 4, 5] and rejected.model_input.to_ints() == [2, 3, 7]
    assert prompt_length(chosen) == 2 and report.prompt_truncated == report.truncated == 1
    weighted = [{"chosen": [1, 2, 3], "rejected": [1, 4], "chosen_weights": [0, 0, 1], "rejected_weights": [0, 1]}]
    assert len(preference_datums(weighted, max_length=3, progress=False)[0]) == 2  # fits: kept as it is
    with pytest.raises(ValueError, match=r"pair 0 \(item 0 of the data list\): the chosen sequence .* is not truncated"):
        preference_datums(weighted, max_length=2, progress=False)


def test_no_pair_is_kept_with_an_empty_completion() -> None:
    assert apply_length_limits([1, 2, 3], [1, 2, 4], 3)[3] == ["dropped_empty_completion"]
    assert apply_length_limits([1, 2, 3, 4], [1, 2, 5], 2, max_length=3)[3] == ["truncated"]
    chosen, rejected, prompt, events = apply_length_limits([9, 1, 2, 3, 4], [9, 1, 2, 5], 3, max_prompt_length=1)
    assert (chosen, rejected, prompt, events) == ([2, 3, 4], [2, 5], 1, ["prompt_truncated"])
    # an empty prompt whose two sequences start differently cannot share a first token: dropped, counted
    records = [{"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1}]
    assert preference_datums(records, progress=False)[1].num_pairs == 1


def test_the_records_read_preference_records_read_are_tokenized_as_their_file_is(tmp_path: Path, tokenizer: Any
                                                                                  ) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}\n'
                    '{"prompt": "Grass is", "chosen": " green.", "rejected": " red."}\n')
    from_records, _ = preference_datums(read_preference_records(str(path)), tokenizer, progress=False)
    from_file, _ = preference_datums(str(path), tokenizer, progress=False)
    assert [datum.model_input.to_ints() for datum in from_records] == [datum.model_input.to_ints() for datum in from_file]
