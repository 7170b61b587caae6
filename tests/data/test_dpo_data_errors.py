"""A bad preference file says which file and which line: bytes that are not UTF-8, token ids outside the vocabulary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loops_callbacks.data import DPODataModule, read_dpo_jsonl
from loops_callbacks.data.dpo import OutOfVocabularyError


class SmallVocabulary:
    """A reference client whose vocabulary is ids 0..15."""

    vocab_size = 16

    def compute_logprobs(self, prompt: object) -> list[float | None]:
        return [None] + [-1.0] * (prompt.length - 1)  # type: ignore[attr-defined]


def pairs_file(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def record(chosen: list[int], rejected: list[int]) -> bytes:
    return json.dumps({"chosen": chosen, "rejected": rejected, "prompt_length": 1}).encode()


@pytest.fixture
def latin1_file(tmp_path: Path) -> Path:
    # line 3 holds a Latin-1 "é" (0xe9), which is not UTF-8; line 2 is blank, so it is pair 1
    bad = b'{"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1, "note": "caf\xe9"}'
    return pairs_file(tmp_path / "pairs.jsonl", [record([1, 2], [1, 3]), b"", bad])


def test_read_dpo_jsonl_names_the_file_and_line_of_bytes_that_are_not_utf8(latin1_file: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(f"pair 1 (line 3 of {latin1_file}): not UTF-8 text (byte 0xe9")):
        read_dpo_jsonl(latin1_file)


def test_the_datamodule_names_the_file_and_line_of_bytes_that_are_not_utf8(latin1_file: Path) -> None:
    data = DPODataModule(path=str(latin1_file), use_cache=False, progress=False)
    with pytest.raises(ValueError, match=re.escape(f"pair 1 (line 3 of {latin1_file}): not UTF-8 text")) as error:
        data.dpo_data()
    assert not isinstance(error.value, UnicodeDecodeError)


def test_an_out_of_vocabulary_id_names_the_pair_and_the_line_of_the_file(tmp_path: Path) -> None:
    path = pairs_file(tmp_path / "pairs.jsonl", [record([1, 2], [1, 3]), b"", record([1, 5], [1, 6]),
                                                 record([1, 2, 99], [1, 4])])
    data = DPODataModule(path=str(path), reference=SmallVocabulary(), use_cache=False, progress=False)
    with pytest.raises(OutOfVocabularyError) as error:
        data.setup("fit")
        data.scored_pairs  # noqa: B018  (with a lazily scored reference, the check runs here)
    assert str(error.value) == (
        f"pair 2 (line 4 of {path}): the chosen datum (index 4) has token id 99 at position 2, "
        "outside the reference's vocabulary [0, 16)"
    )
    assert (error.value.pair, error.value.index, error.value.position, error.value.token) == (2, 4, 2, 99)
    assert isinstance(error.value, ValueError)


def test_in_memory_datums_keep_the_plain_message() -> None:
    from loops_callbacks.data import dpo_pair_datums

    data = DPODataModule(data=[*dpo_pair_datums([1, 2], [1, 3], 1), *dpo_pair_datums([1, 40], [1, 3], 1)],
                         reference=SmallVocabulary(), use_cache=False, progress=False)
    with pytest.raises(OutOfVocabularyError, match=r"^pair 1: the chosen datum \(index 2\) has token id 40 at position 1"):
        data.setup("fit")
        data.scored_pairs  # noqa: B018


@pytest.mark.parametrize("token", [2**70, 2**63, -3])
def test_a_token_id_outside_int64_or_negative_names_the_file_line_key_and_value(tmp_path: Path, token: int) -> None:
    path = pairs_file(tmp_path / "pairs.jsonl", [record([1, 2], [1, 3]), record([1, 4, 5], [1, 6, token])])
    with pytest.raises(ValueError, match=re.escape(
        f"pair 1 (line 2 of {path}): the rejected sequence has token id {token} at position 2; token ids are ints "
        "in [0, 2**63)"
    )):
        read_dpo_jsonl(path)


PEAK_WHILE_REJECTING = """
import resource, sys
from loops_callbacks.data.sources import read_preference_records

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_preference_records(sys.argv[1])
except ValueError as error:
    print(error)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_rejecting_a_large_file_of_nuls_takes_bounded_memory(tmp_path: Path, suffix: str) -> None:
    """128 MiB of NULs, one line: read whole, it took twice its size (bytes, then text) before its error."""
    import subprocess
    import sys

    path = tmp_path / f"pairs{suffix}"
    with open(path, "wb") as file:
        file.truncate(128 << 20)  # sparse: no disk written
    done = subprocess.run([sys.executable, "-c", PEAK_WHILE_REJECTING, str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    *message, growth = done.stdout.splitlines()
    assert float(growth) < 96, done.stdout  # MB of peak RSS growth: reading one line of 32 MiB takes 64
    assert message == [f"pair 0 (line 1 of {path}): longer than 32 MiB without a line break, which no preference "
                       "record is (a binary or damaged file?)"], done.stdout


def test_a_line_longer_than_the_limit_is_named_and_shorter_ones_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loops_callbacks.data import sources

    long = record([1] * 400, [1, 2])
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", len(long))
    path = pairs_file(tmp_path / "pairs.jsonl", [record([1, 2], [1, 3]), long, long + b" "])
    with pytest.raises(ValueError, match=re.escape(f"pair 2 (line 3 of {path}): longer than 0 MiB without")):
        read_dpo_jsonl(path)
    path.write_bytes(record([1, 2], [1, 3]) + b"\n" + long)  # at the limit, without a last line break
    assert len(read_dpo_jsonl(path)) == 4
