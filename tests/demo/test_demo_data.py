"""Demo data: prompt batches, preference pairs, their JSONL files and padded batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loops_callbacks.data import dpo_pair_datums, read_dpo_jsonl
from loops_callbacks.demo.data import PromptDataModule, make_preference_pairs, write_preference_jsonl
from loops_callbacks.demo.tasks import ReverseDigitsTask


def test_prompt_datamodule_sized_and_infinite() -> None:
    sized = PromptDataModule(num_digits=3, num_symbols=4, batch_size=5, num_batches=3, seed=7)
    sized.setup("fit")
    batches = list(sized.train_dataloader())
    assert len(batches) == len(sized.train_dataloader()) == 3
    assert all(b["prompt_ids"].shape == (5, 5) and b["prompt_ids"].dtype == torch.long for b in batches)
    # the same seed gives the same prompts each epoch
    again = list(sized.train_dataloader())
    assert all(torch.equal(a["prompt_ids"], b["prompt_ids"]) for a, b in zip(batches, again))

    endless = PromptDataModule(num_digits=3, batch_size=2)
    endless.setup("fit")
    iterator = iter(endless.train_dataloader())
    assert [next(iterator)["prompt_ids"].shape for _ in range(50)] == [torch.Size([2, 5])] * 50


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"batch_size": 0}, "batch_size.*0"), ({"num_batches": -2}, "num_batches.*-2")]
)
def test_prompt_datamodule_rejects_bad_sizes(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PromptDataModule(**kwargs)


def test_preference_pairs_are_correct_versus_corrupted() -> None:
    task = ReverseDigitsTask(num_digits=4, num_symbols=6)
    pairs = make_preference_pairs(task, 100, seed=3, num_corrupted=2)
    assert pairs == make_preference_pairs(task, 100, seed=3, num_corrupted=2)  # seeded
    for chosen, rejected, prompt_length in pairs:
        assert prompt_length == task.prompt_length and len(chosen) == len(rejected) == 11
        assert chosen[:prompt_length] == rejected[:prompt_length]
        prompt = chosen[:prompt_length]
        assert task.reward(prompt, chosen[prompt_length:]) == 1.0
        assert task.reward(prompt, rejected[prompt_length:]) == pytest.approx(3 / 5)
        assert set(task.tokenizer.decode(rejected[prompt_length:-1])) <= set("012345")
    with pytest.raises(ValueError, match="num_corrupted.*5"):
        make_preference_pairs(task, 1, num_corrupted=5)


def test_jsonl_is_what_the_dpo_data_module_reads(tmp_path: Path) -> None:
    pairs = make_preference_pairs(ReverseDigitsTask(num_digits=2), 4, seed=0)
    path = tmp_path / "pairs.jsonl"
    write_preference_jsonl(path, pairs)
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    assert json.loads(lines[0]) == {"chosen": pairs[0][0], "rejected": pairs[0][1], "prompt_length": 4}

    datums = read_dpo_jsonl(path)  # what DPODataModule(jsonl_path=...) reads
    assert [d.model_input.to_ints() for d in datums] == [tokens for c, r, _ in pairs for tokens in (c, r)]
    in_memory = [d for c, r, k in pairs for d in dpo_pair_datums(c, r, k)]
    assert [d.loss_fn_inputs["weights"].data for d in datums] == [d.loss_fn_inputs["weights"].data for d in in_memory]
    # position k weighs the token predicted at k: the 3 response tokens are predicted at 3, 4, 5
    assert datums[0].loss_fn_inputs["weights"].data == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
