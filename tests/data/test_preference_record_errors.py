"""Bad preference records and files are named (file and line, the key, the fix); doubtful ones are warned about.

The tokenizer is the shipped chat tokenizer (``configs/data/chat_tokenizer``); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from loops_callbacks.data import read_dpo_jsonl  # noqa: E402
from loops_callbacks.data.sources import read_preference_records  # noqa: E402
from loops_callbacks.optional import HF_EXTRA_HINT, import_optional  # noqa: E402
from loops_callbacks.data.tokenization import PreferenceDataWarning  # noqa: E402
from loops_callbacks.data.tokenizer import load_tokenizer  # noqa: E402
from tests.data.test_preference_data import preference_datums  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_PATH = str(ROOT / "configs" / "data" / "chat_tokenizer")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_PATH)


def chat(chosen: Any = "Hello!", rejected: Any = "Go away.", **extra: Any) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
        **extra,
    }


def jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def datums(source: Any, tokenizer: Any, **kwargs: Any) -> Any:
    return preference_datums(source, tokenizer, progress=False, **kwargs)


# ----------------------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize(
    "key", ["tokenize", "add_generation_prompt", "return_dict", "chat_template", "tools", "messages"]
)
def test_chat_template_kwargs_may_hold_template_variables_only(key: str, tokenizer: Any, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "pairs.jsonl", [chat(), chat(chat_template_kwargs={key: "{{ 'x' }}"})])
    with pytest.raises(
        ValueError, match=re.escape(f"line 2 of {path}: chat_template_kwargs sets {key!r}, an argument")
    ):
        datums(str(path), tokenizer)


def test_chat_template_kwargs_may_not_replace_a_special_token(tokenizer: Any, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "pairs.jsonl", [chat(chat_template_kwargs={"bos_token": ""})])
    with pytest.raises(
        ValueError, match=re.escape(f"line 1 of {path}: chat_template_kwargs sets 'bos_token', which would")
    ):
        datums(str(path), tokenizer)


def test_template_variables_still_pass(tokenizer: Any) -> None:
    data, report = datums([chat(chat_template_kwargs={"enable_thinking": False})], tokenizer)
    assert report.num_pairs == 1 and len(data) == 2


@pytest.mark.parametrize(
    "record, key",
    [
        ({"prompt": "Hi", "chosen": "fine \ud800 not", "rejected": "no"}, "chosen"),
        (chat(rejected="fine \udfff not"), "rejected[0]['content']"),
    ],
)
def test_text_with_a_lone_surrogate_names_the_file_line_and_key(
    record: dict[str, Any], key: str, tokenizer: Any, tmp_path: Path
) -> None:
    """JSON's "\\ud800" escape unpaired is a str no tokenizer takes (the tokenizer's TypeError named nothing)."""
    path = jsonl(tmp_path / "pairs.jsonl", [chat(), record])  # json.dumps writes the escape
    with pytest.raises(ValueError, match=re.escape(f"line 2 of {path}: {key} holds a lone surrogate")):
        datums(str(path), tokenizer)


# ----------------------------------------------------------------------------- warnings with a count


def caught_warnings(source: Any, tokenizer: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = datums(source, tokenizer)
    return report, [str(w.message) for w in caught if issubclass(w.category, PreferenceDataWarning)]


def test_identical_chosen_and_rejected_are_counted_and_named(tokenizer: Any, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "pairs.jsonl", [chat(), chat("Same.", "Same."), chat("Again.", "Again.")])
    report, messages = caught_warnings(str(path), tokenizer)
    assert report.identical == 2 and report.num_pairs == 3
    assert len(messages) == 1
    assert re.search(
        rf"2 of 3 pair\(s\) have the same chosen and rejected sequence.*\(first: line 2 of {re.escape(str(path))}\)",
        messages[0],
    )


def test_identical_token_id_pairs_are_counted_too(tokenizer: Any) -> None:
    records = [
        {"chosen": [1, 2, 3], "rejected": [1, 2, 3], "prompt_length": 1},
        {"chosen": [1, 2, 3], "rejected": [1, 2, 4], "prompt_length": 1},
    ]
    report, messages = caught_warnings(records, None)
    assert report.identical == 1 and "item 0 of the data list" in messages[0]


def test_identical_after_max_length_is_counted(tokenizer: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, report = datums([chat("Same start, then one end.", "Same start, then another.")], tokenizer, max_length=12)
    assert report.truncated == 1 and report.identical == 1


def test_an_unusual_role_is_counted_and_named(tokenizer: Any) -> None:
    record = chat()
    record["prompt"] = [{"role": "usr", "content": "Hi"}]
    report, messages = caught_warnings([chat(), record], tokenizer)
    assert report.unusual_role == 1
    assert "1 of 2 pair(s) have a message role outside" in messages[0]
    assert "item 1 of the data list: prompt[0] has role 'usr'" in messages[0]


def test_a_completion_that_is_not_an_assistant_turn_is_counted_and_named(tokenizer: Any) -> None:
    record = chat()
    record["chosen"] = [{"role": "user", "content": "Thanks"}]
    report, messages = caught_warnings([record], tokenizer)
    assert report.completion_not_assistant == 1
    assert "item 0 of the data list: chosen starts with a 'user' turn" in messages[0]


# ----------------------------------------------------------------------------- unclear crashes, now named


def test_a_message_without_content_is_named(tokenizer: Any, tmp_path: Path) -> None:
    record = chat()
    del record["chosen"][0]["content"]
    path = jsonl(tmp_path / "pairs.jsonl", [chat(), record])
    with pytest.raises(ValueError, match=re.escape(f"line 2 of {path}: chosen[0] (role 'assistant') has no 'content'")):
        datums(str(path), tokenizer)


def test_an_assistant_message_with_tool_calls_needs_no_content(tokenizer: Any) -> None:
    from loops_callbacks.data.preference import parse_preference

    record = chat()
    record["chosen"] = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]
    assert parse_preference(record, "x").format == "conversational"


@pytest.mark.parametrize("content", [42, [1, 2], [{"type": "image", "url": "x.png"}], {"text": "a"}, []])
def test_content_that_is_not_text_is_named(content: Any, tokenizer: Any, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "pairs.jsonl", [chat(rejected=content)])
    with pytest.raises(
        TypeError, match=re.escape(f"line 1 of {path}: rejected[0] (role 'assistant') has 'content' that is")
    ):
        datums(str(path), tokenizer)


def test_text_parts_are_accepted_and_a_template_that_cannot_render_them_names_the_record(
    tokenizer: Any, tmp_path: Path
) -> None:
    parts = [{"type": "text", "text": "Hello!"}]
    path = jsonl(tmp_path / "pairs.jsonl", [chat(), chat(chosen=parts)])
    # the shipped template concatenates content as a string: it fails, and the record is named
    with pytest.raises(ValueError, match=re.escape(f"line 2 of {path}: the chat template of")):
        datums(str(path), tokenizer)


def test_a_tools_string_that_is_not_json_is_named(tokenizer: Any, tmp_path: Path) -> None:
    path = jsonl(tmp_path / "pairs.jsonl", [chat(tools='[{"name": "f",')])
    with pytest.raises(ValueError, match=re.escape(f"line 1 of {path}: 'tools' is a string that is not valid JSON")):
        datums(str(path), tokenizer)


def test_tools_that_are_not_a_list_of_schemas_are_named(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=re.escape("item 0 of the data list: 'tools' must be a list of tool schemas")):
        datums([chat(tools='"search"')], tokenizer)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deeply_nested_json_is_named(suffix: str, tmp_path: Path) -> None:
    path = tmp_path / f"pairs{suffix}"
    path.write_text(
        json.dumps({"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1})
        + "\n"
        + '{"chosen": '
        + "[" * 100_000
        + "]" * 100_000
        + "}\n"
    )
    with pytest.raises(ValueError, match="nested deeper than Python's parser allows") as error:
        read_preference_records(str(path))
    assert str(path) in str(error.value)
    if suffix == ".jsonl":
        assert f"line 2 of {path}" in str(error.value)


def test_a_json_file_holding_one_pretty_printed_object_is_one_record(tmp_path: Path) -> None:
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}, indent=2))
    (record,) = read_preference_records(str(path))
    assert record.record["chosen"] == "b" and record.where == f"the object in {path}"


def test_a_jsonl_file_holding_one_pretty_printed_document_says_so(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps([{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2, indent=2))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "holds one JSON document (an array) over several lines, not one record "
            f"per line: name it {tmp_path / 'pairs'}.json"
        ),
    ):
        read_preference_records(str(path))


def test_a_broken_pretty_printed_json_array_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "pairs.json"
    path.write_text('[\n  {"chosen": "b", "rejected": "c"},\n  {"chosen": "b" "rejected": "c"}\n]\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid JSON at line 3 column 18")):
        read_preference_records(str(path))


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink loop"])
@pytest.mark.parametrize("reader", ["preference", "dpo_jsonl"])
def test_a_path_that_is_not_a_regular_file_is_named_for_what_it_is(kind: str, reader: str, tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    if kind == "directory":
        path.mkdir()
        expected = "is a directory"
    elif kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.fail("this platform has no FIFOs; the test needs them")
        os.mkfifo(path)
        expected = "is a FIFO (named pipe)"
    else:
        path.symlink_to(tmp_path / "other.jsonl")
        (tmp_path / "other.jsonl").symlink_to(path)
        expected = "cannot be opened: Too many levels of symbolic links"
    read = read_preference_records if reader == "preference" else read_dpo_jsonl
    started = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(f"preference file {str(path)!r} {expected}")):
        read(str(path))
    assert time.monotonic() - started < 5  # a FIFO is never opened (that would block)


def test_a_missing_tokenizer_path_fails_at_once_with_the_fix(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(
        ValueError, match=re.escape(f"tokenizer {str(tmp_path / 'nowhere')!r} does not exist: give the directory")
    ):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="is a file, not a directory"):
        load_tokenizer(str(Path(TOKENIZER_PATH) / "tokenizer.json"))
    assert time.monotonic() - started < 10


def test_an_uncached_hub_name_offline_fails_at_once_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"'no-such-org/no-such-tokenizer' is neither a local directory nor in the local "
        r"Hugging Face cache, and the Hub is offline .*hf download no-such-org/",
    ):
        load_tokenizer("no-such-org/no-such-tokenizer")
    assert time.monotonic() - started < 10


def test_the_hf_extra_hint_is_the_checkouts_editable_install_and_ends_the_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    assert (ROOT / "pyproject.toml").is_file()  # these tests run from a checkout
    assert HF_EXTRA_HINT.endswith('pip install -e ".[hf]"') and str(ROOT) in HF_EXTRA_HINT
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError) as error:
        import_optional("transformers", "x")
    assert str(error.value).endswith(HF_EXTRA_HINT)


def test_an_uncached_hub_name_without_a_network_fails_at_once_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def no_dns(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"'no-such-org/no-such-tokenizer' is neither a local directory nor in the local "
        r"Hugging Face cache, and the Hub cannot be reached \(huggingface.co does not "
        r"resolve.*set HF_HUB_OFFLINE=1",
    ):
        load_tokenizer("no-such-org/no-such-tokenizer")
    assert time.monotonic() - started < 10  # not ~50 s of retries


def test_the_hf_extra_hint_outside_a_checkout_names_the_extras_packages() -> None:
    import tomllib

    from loops_callbacks.optional import HF_EXTRA_PACKAGES, _hf_extra_hint

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    assert list(HF_EXTRA_PACKAGES) == extra  # one list, kept equal to the extra
    assert _hf_extra_hint(ROOT / "no-such-dir") == "pip install " + " ".join(f'"{r}"' for r in extra)
