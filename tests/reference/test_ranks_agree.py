"""Ranks that read different data, tokenizers or limits stop before any scoring, each naming the difference.

Two gloo ranks on the CPU: a real ``lightning.Trainer`` (DDP) where each rank reads its own copy of
the preference file, and plain calls for the generic path (a user's datums given to
``ReferenceLogprobsMixin``), the tokenizer and the limits. Every rank must raise the same clear
error, and no cache file may be written. Then the sharded tokenization: each rank tokenizes half of
the records, and every rank gets the same datums as one process tokenizing them all. All the cases
share one pair of processes and one process group (``ranks``: every case runs in it, one after the
other), since starting the processes costs far more than any case.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from loops_callbacks.data import DPODataModule, ReferenceLogprobsMixin, dpo_pair_datums
from tests.helpers import ToyDPO, free_port, run_two_ranks

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "configs" / "data" / "chat_tokenizer")
CHAT = ROOT / "configs" / "data" / "chat_preferences.jsonl"


def token_records(num_pairs: int, changed: int | None = None) -> list[dict[str, Any]]:
    """Token-id records (vocabulary 16); record ``changed`` gets another rejected completion."""
    records = []
    for index in range(num_pairs):
        prompt = [1 + index % 7, 2 + index % 5, 3]
        rejected = [4 + index % 3, 9] if index != changed else [11, 12, 13]
        records.append({"chosen": prompt + [5, 6 + index % 4], "rejected": prompt + rejected, "prompt_length": 3})
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


class PerRankFile(DPODataModule):
    """Rank r reads ``template.format(rank=r)`` (a node-local copy out of sync), and writes what it raised."""

    def __init__(self, template: str, **kwargs: Any) -> None:
        super().__init__(path=template.format(rank=0), **kwargs)  # each rank names its own file in setup
        self.template = template

    @override
    def setup(self, stage: str) -> None:
        rank = self.trainer.global_rank
        template = self.template
        self.path = template.format(rank=rank)
        try:
            super().setup(stage)
        except Exception as error:
            Path(template).parent.joinpath(f"rank{rank}.error").write_text(f"{type(error).__name__}: {error}")
            raise


def fit_two_ranks(datamodule: L.LightningDataModule, root: Path) -> None:
    """A 2-step DDP fit on the two ranks of the process group this rank is in."""
    trainer = L.Trainer(
        default_root_dir=str(root), accelerator="cpu", strategy=DDPStrategy(timeout=timedelta(seconds=60)), devices=2,
        max_steps=2, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False,
    )
    torch.manual_seed(0)
    trainer.fit(ToyDPO(), datamodule=datamodule)


def rank_errors(directory: Path) -> list[str]:
    return [(directory / f"rank{rank}.error").read_text() for rank in (0, 1)]


def cache_files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()] if directory.exists() else []


# ----------------------------------------------------------------------------- the cases, in one process group


CASES = ("generic", "limits", "tokenizer", "sharded", "dropped_share", "missing_file", "invalid_on_one_rank",
         "files_same_count", "files_different_count")


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # a Trainer's DDP finds this group
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    try:
        for case in CASES:  # one after the other in the one group: each fails (or not) on both ranks alike
            directory = Path(out_dir) / case
            directory.mkdir(exist_ok=True)
            try:
                results[case] = globals()[f"_case_{case}"](rank, directory)
            except Exception as error:  # noqa: BLE001 - the test reads it
                results[case] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's result on each rank, ``{case: [rank 0's, rank 1's]}``, and where each case wrote."""
    out_dir = tmp_path_factory.mktemp("ranks")
    results = run_two_ranks(_worker, (free_port(), str(out_dir)), out_dir, "the plain cases")
    return {case: [result[case] for result in results] for case in CASES} | {"dir": out_dir}


class FlatClient:
    """A SamplingClient with a fingerprint: -0.5 everywhere."""

    vocab_size = 16

    def fingerprint(self) -> str:
        return "flat-v1"

    def compute_logprobs(self, prompt: Any) -> list[float | None]:
        return [None] + [-0.5] * (prompt.length - 1)


class OwnData(ReferenceLogprobsMixin, L.LightningDataModule):
    """A user's DataModule over its own datums (``changed``: rank 1's pair 4 gets another rejected completion, or
    ``odd``: rank 1's ``dpo_data()`` has a datum too many)."""

    def __init__(self, rank: int, *, changed: bool = False, odd: bool = False, cache_dir: Path | None = None) -> None:
        super().__init__()
        self.rank, self.changed, self.odd = rank, changed, odd
        self.configure_reference(FlatClient(), cache_dir=cache_dir, use_cache=cache_dir is not None, progress=False)

    def dpo_data(self) -> list[Any]:
        records = token_records(6 if self.changed else 4, changed=4 if self.changed and self.rank == 1 else None)
        data = [d for r in records for d in dpo_pair_datums(r["chosen"], r["rejected"], prompt_length=3)]
        return data + data[:1] if self.odd and self.rank == 1 else data


def _case_generic(rank: int, out_dir: Path) -> dict[str, Any]:
    OwnData(rank, changed=True, cache_dir=out_dir / "cache").setup("fit")
    return {}


def _case_limits(rank: int, out_dir: Path) -> dict[str, Any]:
    module = DPODataModule(path=str(CHAT), tokenizer=TOKENIZER, max_length=64 if rank == 0 else 48, progress=False)
    module.dpo_data()
    return {}


def _case_tokenizer(rank: int, out_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    if rank == 1:
        tokenizer.chat_template = tokenizer.chat_template.replace("\n", "\n\n", 1)
    module = DPODataModule(path=str(CHAT), tokenizer=tokenizer, progress=False)
    module.dpo_data()
    return {}


def _case_sharded(rank: int, out_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    rendered: list[int] = []
    render = tokenizer.apply_chat_template

    def counting(conversations: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("add_generation_prompt"):  # the prompts rendered: one conversation, or a batch of them
            rendered.append(len(conversations) if isinstance(conversations[0], list) else 1)
        return render(conversations, *args, **kwargs)

    tokenizer.apply_chat_template = counting
    module = DPODataModule(path=str(CHAT), tokenizer=tokenizer, max_length=40, progress=False)
    data = module.dpo_data()
    report = module.tokenization_report
    return {
        "tokens": [d.model_input.to_ints() for d in data.datums()],
        "weights": [list(d.loss_fn_inputs["weights"].data) for d in data.datums()],
        "tokenized": rendered,
        "report": report,
        "where": data.where,
    }


def _case_missing_file(rank: int, out_dir: Path) -> dict[str, Any]:
    path = write_jsonl(out_dir / "pairs.jsonl", token_records(4)) if rank == 0 else str(out_dir / "absent.jsonl")
    DPODataModule(path=path, progress=False).dpo_data()
    return {}


def _case_invalid_on_one_rank(rank: int, out_dir: Path) -> dict[str, Any]:
    OwnData(rank, odd=True).setup("fit")
    return {}


def dropped_first_half() -> list[dict[str, Any]]:
    """Token-id records whose first half have prompts too long for ``max_length=5``: rank 0 keeps no pair."""
    long = [{"chosen": [1, 2, 3, 4, 5, 6, 7], "rejected": [1, 2, 3, 4, 5, 6, 8], "prompt_length": 6}] * 4
    return long + token_records(4)


def _files_case(rank: int, out_dir: Path, rank1_pairs: int) -> dict[str, Any]:
    """Rank r's Trainer reads ``files/pairs.<r>.jsonl``: 8 pairs on rank 0, ``rank1_pairs`` on rank 1 (8: pair 5
    differs)."""
    files = out_dir / "files"
    files.mkdir(exist_ok=True)
    if rank == 0:
        write_jsonl(files / "pairs.0.jsonl", token_records(8))
    else:
        write_jsonl(files / "pairs.1.jsonl", token_records(rank1_pairs, changed=5 if rank1_pairs == 8 else None))
    module = PerRankFile(str(files / "pairs.{rank}.jsonl"), batch_size=2, cache_dir=str(out_dir / "cache"),
                         progress=False)
    fit_two_ranks(module, out_dir / f"root{rank}")
    return {}


def _case_files_same_count(rank: int, out_dir: Path) -> dict[str, Any]:
    return _files_case(rank, out_dir, 8)


def _case_files_different_count(rank: int, out_dir: Path) -> dict[str, Any]:
    return _files_case(rank, out_dir, 9)


def _case_dropped_share(rank: int, out_dir: Path) -> dict[str, Any]:
    module = DPODataModule(data=dropped_first_half(), max_length=5, progress=False)
    data = module.dpo_data()
    return {"tokens": [d.model_input.to_ints() for d in data.datums()], "report": module.tokenization_report}


@pytest.mark.parametrize("rank1_pairs", [8, 9], ids=["same_count", "different_count"])
def test_ranks_reading_different_files_stop_with_the_first_differing_pair(ranks: dict[str, Any], rank1_pairs: int) -> None:
    case = "files_same_count" if rank1_pairs == 8 else "files_different_count"
    for result in ranks[case]:  # the fit failed on every rank
        assert "different" in result.get("error", ""), result
    files = ranks["dir"] / case / "files"
    first = 5 if rank1_pairs == 8 else 8
    counts = "rank 0: 8 pairs, rank 1: 8 pairs" if rank1_pairs == 8 else "rank 0: 8 pairs, rank 1: 9 pairs"
    for message in rank_errors(files):
        assert message.startswith("RanksDisagreeError: the ranks read different preference records"), message
        assert counts in message, message
        assert f"the first difference is pair {first}:" in message, message
        if rank1_pairs == 8:
            assert f"rank 0: line 6 of {files / 'pairs.0.jsonl'}" in message, message
            assert f"rank 1: line 6 of {files / 'pairs.1.jsonl'}" in message, message
        else:
            assert "rank 0: none (8 pairs)" in message, message
            assert f"rank 1: line 9 of {files / 'pairs.1.jsonl'}" in message, message
    assert cache_files(ranks["dir"] / case / "cache") == []


def test_a_users_datums_that_differ_across_ranks_stop_before_scoring(ranks: dict[str, Any]) -> None:
    for result in ranks["generic"]:
        message = result.get("error", "")
        assert message.startswith("RanksDisagreeError: the ranks hold different datums"), message
        assert "rank 0: 12 datums, rank 1: 12 datums" in message, message
        assert "the first difference is pair 4: the rejected datum (index 9)" in message, message
    assert cache_files(ranks["dir"] / "generic" / "cache") == []


@pytest.mark.parametrize(("case", "setting"), [("limits", "max_length"), ("tokenizer", "chat template")])
def test_ranks_with_other_limits_or_tokenizers_stop_before_tokenizing(ranks: dict[str, Any], case: str,
                                                                      setting: str) -> None:
    for result in ranks[case]:
        message = result.get("error", "")
        assert message.startswith("RanksDisagreeError: the ranks use different settings"), message
        assert re.search(rf"\({setting}: rank 0: \S+, rank 1: \S+\)", message), message  # and nothing else


def test_each_rank_tokenizes_half_and_all_get_what_one_process_gets(ranks: dict[str, Any]) -> None:
    single = DPODataModule(path=str(CHAT), tokenizer=TOKENIZER, max_length=40, progress=False)
    data = single.dpo_data()
    assert all("error" not in result for result in ranks["sharded"]), ranks["sharded"]
    assert [sum(result["tokenized"]) for result in ranks["sharded"]] == [256, 256]  # half of the 512 records each
    for result in ranks["sharded"]:
        assert result["tokens"] == [d.model_input.to_ints() for d in data.datums()]
        assert result["weights"] == [list(d.loss_fn_inputs["weights"].data) for d in data.datums()]
        assert result["report"] == single.tokenization_report  # counts, examples, the record of each pair
        assert result["report"].truncated > 0 and result["report"].dropped_prompt_fills_max_length > 0
        assert result["where"] == data.where


def test_a_rank_whose_share_keeps_no_pair_still_gets_every_pair(ranks: dict[str, Any]) -> None:
    single = DPODataModule(data=dropped_first_half(), max_length=5, progress=False)
    data = single.dpo_data()
    assert single.tokenization_report.dropped_prompt_fills_max_length == 4
    for result in ranks["dropped_share"]:
        assert "error" not in result, result
        assert result["tokens"] == [d.model_input.to_ints() for d in data.datums()]
        assert result["report"] == single.tokenization_report


def test_a_rank_that_cannot_read_its_file_stops_every_rank(ranks: dict[str, Any]) -> None:
    rank0, rank1 = (result.get("error", "") for result in ranks["missing_file"])
    absent = str(ranks["dir"] / "missing_file" / "absent.jsonl")
    assert absent in rank1, rank1
    assert rank0.startswith("RuntimeError: reading the preference records failed on another rank (rank 1: "), rank0
    assert absent in rank0, rank0


def test_pairs_that_fail_their_check_on_one_rank_stop_every_rank(ranks: dict[str, Any]) -> None:
    rank0, rank1 = (result.get("error", "") for result in ranks["invalid_on_one_rank"])
    assert rank1.startswith("ValueError: ") and "odd" in rank1, rank1
    assert rank0.startswith("ValueError: checking the DPO pairs failed on another rank (rank 1: ValueError: "), rank0
