"""Token ids equal those TRL's ``DPOTrainer`` trains on, for the shipped tokenizer and data.

``tests/golden/trl_dpo_golden.json`` holds what TRL produced (version inside; made by
``tests/golden/make_trl_dpo_golden.py`` in a separate environment with TRL installed): for each
case, every kept pair's chosen and rejected ``input_ids`` (after TRL's collator, so truncated by
``max_length``) and where its completion mask starts, as a sha256 digest, the first pairs in clear.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.data.test_preference_data import preference_datums  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "trl_dpo_golden.json").read_text())
TOKENIZER = str(ROOT / "configs" / "data" / "chat_tokenizer")
SHIPPED = str(ROOT / "configs" / "data" / "chat_preferences.jsonl")


def our_rows(source: Any, max_length: int | None) -> list[list]:
    """``[record index, chosen ids, rejected ids, chosen start, rejected start]`` per kept pair, as the golden file."""
    data, report = preference_datums(source, TOKENIZER, max_length=max_length, progress=False, warn=False)
    rows = []
    for pair, index in enumerate(report.record_indices):
        row: list[Any] = [index]
        starts = []
        for datum in data[2 * pair : 2 * pair + 2]:
            row.append(datum.model_input.to_ints())
            weights = datum.loss_fn_inputs["weights"].data
            starts.append(next(k for k, w in enumerate(weights) if w > 0) + 1)  # weight k belongs to token k + 1
        rows.append(row + starts)
    return rows


@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_token_ids_equal_trl_dpo_trainer(case: str) -> None:
    expected = GOLDEN["cases"][case]
    source = SHIPPED if expected["records"] is None else expected["records"]
    if expected["num_kept"] == 0:
        with pytest.raises(ValueError, match="no preference pair left"):
            our_rows(source, expected["max_length"])
        return
    rows = our_rows(source, expected["max_length"])
    assert rows[: len(expected["first"])] == expected["first"]
    assert len(rows) == expected["num_kept"]
    assert hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest() == expected["sha256"]


def test_the_golden_file_covers_every_format_and_a_split_inside_the_prompt() -> None:
    from transformers import AutoTokenizer

    cases = GOLDEN["cases"]
    assert GOLDEN["versions"]["trl"].startswith("1.")
    # a trailing space in the prompt merges with the completion's first word: the completion starts
    # inside the tokenized prompt, for TRL and for us (with one warning)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    case = cases["standard_trailing_space"]
    for record, row in zip(case["records"], case["first"]):
        assert row[3] == row[4] < len(tokenizer(record["prompt"])["input_ids"])
    _, report = preference_datums(case["records"], TOKENIZER, progress=False, warn=False)
    assert report.prompt_not_prefix == len(case["records"])
    with pytest.warns(UserWarning, match=r"24 of 24 pair\(s\) have a tokenized prompt that is not a prefix .*prompt end ' '"):
        preference_datums(case["records"], TOKENIZER, progress=False)
    # max_length drops pairs whose prompt fills it, and truncates the others
    assert 0 < cases["conversational_max_length_40"]["num_kept"] < cases["conversational"]["num_kept"]
    assert all(len(row[1]) <= 40 and len(row[2]) <= 40 for row in cases["conversational_max_length_40"]["first"])
