"""The prompt the sampler saw (``sampler_prompt_ids``) against the trainer's: named ``prompt``, observed, with the
first difference; merged over micro-batches and ranks through the states."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loops_callbacks.divergence.guard_rail import GuardRail
from loops_callbacks.divergence.batch import read_step
from loops_callbacks.divergence.report import decode_record
from loops_callbacks.divergence.report import ReportOptions, step_report
from loops_callbacks.divergence.statistics import DivergenceStats
from loops_callbacks.types import Datum, ModelInput
from tests.helpers import reduce_in_threads

B, PROMPT, T = 8, 30, 60


class Words:
    """A tokenizer whose id i reads 'w<i> '."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"w{i} " for i in ids)


def padded(seed: int = 0, *, batch: int = B) -> tuple[dict[str, Any], dict[str, Any]]:
    """A right-padded batch whose completions start at position PROMPT - 1 (the first action token is input id
    PROMPT), the trainer's logprobs close to the sampler's, and the sampler's prompts equal to the trainer's."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (batch, T), generator=generator)
    mask = torch.zeros(batch, T)
    mask[:, PROMPT - 1 : T - 1] = 1.0
    sampler = -torch.rand(batch, T, generator=generator) * 3
    trainer = sampler + 1e-4 * torch.randn(batch, T, generator=generator)
    batch_ = {"input_ids": ids, "target_tokens": torch.cat([ids[:, 1:], torch.zeros(batch, 1, dtype=torch.long)], 1),
              "logprobs": sampler, "mask": mask}
    return {"training_logprobs": trainer, "sampler_prompt_ids": ids[:, :PROMPT].clone()}, batch_


def stats(outputs: dict[str, Any], batch: dict[str, Any]) -> DivergenceStats:
    return DivergenceStats.from_batch(read_step(outputs, batch))


def diagnosis(host: Any, tokenizer: Any = None) -> Any:
    return step_report(host, ReportOptions(tokenizer=tokenizer), guard_rail=GuardRail()).diagnosis


def test_identical_prompts_name_nothing() -> None:
    host = stats(*padded()).to_host()
    assert host.totals["n_prompt_datums_compared"] == B and host.totals["n_prompt_datums_differ"] == 0
    assert diagnosis(host).cause != "prompt"


def test_a_system_prompt_changed_at_token_12_is_named_with_its_position_and_text() -> None:
    outputs, batch = padded()
    outputs["sampler_prompt_ids"][:, 12] = 7  # another system prompt's token
    found = diagnosis(stats(outputs, batch).to_host(), Words())
    assert found.cause == "prompt" and found.confidence == 1.0 and found.is_observation
    assert found.numbers["prompt_position"] == 12 and found.numbers["prompt_datum"] == 0
    ids = batch["input_ids"][0].tolist()
    message = found.message
    assert "in 8 of 8 compared datums; datum 0 at prompt token 12 (the prompts agree after it):" in message
    assert f"sampler '…{''.join(f'w{i} ' for i in ids[8:12])}⟦w7 w{ids[13]} " in message
    assert f"vs trainer '…{''.join(f'w{i} ' for i in ids[8:12])}⟦w{ids[12]} w{ids[13]} " in message
    assert "chat template" in message and "system prompt" in message


def test_a_dropped_first_token_is_named_at_token_0_with_both_lengths() -> None:
    outputs, batch = padded()
    outputs["sampler_prompt_ids"] = torch.cat([torch.full((B, 1), 1), outputs["sampler_prompt_ids"]], 1)  # a BOS
    found = diagnosis(stats(outputs, batch).to_host())
    assert found.cause == "prompt" and found.numbers["prompt_position"] == 0
    assert "the sampler's prompt has 31 tokens, the trainer's 30" in found.message


def test_without_input_ids_position_0_is_not_compared_but_a_shorter_prompt_still_is() -> None:
    outputs, batch = padded()
    del batch["input_ids"]
    outputs["sampler_prompt_ids"][:, 0] = 3  # position 0: unknown to the trainer here
    host = stats(outputs, batch).to_host()
    assert host.totals["n_prompt_datums_compared"] == B and host.totals["n_prompt_datums_differ"] == 0
    outputs["sampler_prompt_ids"] = torch.cat([torch.full((B, 1), 1), outputs["sampler_prompt_ids"]], 1)
    assert diagnosis(stats(outputs, batch).to_host()).numbers["prompt_position"] == 0


def test_left_padding_in_the_sampler_rows_and_a_longer_padded_trainer_row_are_not_differences() -> None:
    outputs, batch = padded()
    prompts = outputs["sampler_prompt_ids"]
    prompts[1, :5] = -1  # datum 1's sampler prompt is its last 25 ids: the trainer's row may hold left padding
    host = stats(outputs, batch).to_host()
    assert host.totals["n_prompt_datums_differ"] == 0
    prompts[1, 7] = 5
    found = diagnosis(stats(outputs, batch).to_host())
    assert (found.numbers["prompt_datum"], found.numbers["prompt_position"]) == (1, 2)  # counted in its prompt


def left_padded_rows(pad: int) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """``padded()`` with datum 1's row shifted ``pad`` positions right behind left padding (id 0), its prompt the
    last ``PROMPT - pad`` ids, and the ``attention_mask`` marking it."""
    outputs, batch = padded()
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, :pad] = 0
    batch["input_ids"][1, :pad] = 0
    batch["target_tokens"][1, : pad - 1] = 0
    outputs["sampler_prompt_ids"][1, :pad] = -1
    return outputs, batch, attention


def test_with_an_attention_mask_a_trainer_prompt_longer_than_the_sampler_s_is_named() -> None:
    outputs, batch, attention = left_padded_rows(4)
    batch["attention_mask"] = attention
    assert stats(outputs, batch).to_host().totals["n_prompt_datums_differ"] == 0  # left padding, marked: the same
    outputs["sampler_prompt_ids"][:, 0] = -1  # every sampler prompt drops its first id (a BOS the engine would add)
    outputs["sampler_prompt_ids"][1, 4] = -1
    host = stats(outputs, batch).to_host()
    assert host.totals["n_prompt_datums_differ"] == host.totals["n_prompt_datums_compared"] == B
    found = diagnosis(host)
    assert found.cause == "prompt" and found.is_observation and found.numbers["prompt_position"] == 0
    assert f"the sampler's prompt has {PROMPT - 1} tokens, the trainer's {PROMPT}" in found.message
    assert "datum 0 before the sampler's first prompt token (the prompts agree from it on: the trainer's has 1 more " \
           "before it)" in found.message, found.message
    del batch["attention_mask"]  # unmarked: the trainer's extra id may be padding, so it is not a difference
    assert stats(outputs, batch).to_host().totals["n_prompt_datums_differ"] == 0
    batch["attention_mask"] = torch.cat([attention, torch.ones(B, 1, dtype=torch.long)], 1).bool()  # [B, T + 1]
    assert stats(outputs, batch).to_host().totals["n_prompt_datums_differ"] == B


@pytest.mark.parametrize(("value", "error", "said"), [
    ([[1] * T] * B, TypeError, "'attention_mask' is a list; expected a [B, T] tensor"),
    (torch.ones(B, T - 1), ValueError, f"'attention_mask' has shape ({B}, {T - 1}); expected [{B}, {T}]"),
    (torch.ones(B - 1, T), ValueError, f"or [{B}, {T + 1}] (the whole sequences)"),
])
def test_an_attention_mask_that_is_not_the_rows_is_refused(value: Any, error: type, said: str) -> None:
    outputs, batch = padded()
    batch["attention_mask"] = value
    with pytest.raises(error) as raised:
        read_step(outputs, batch)
    assert said in str(raised.value)


def datums(extra: bool = False) -> tuple[list[Datum], list[torch.Tensor], list[list[int]]]:
    data, trainer, prompts = [], [], []
    for i in range(3):
        prompt = [1, 20 + i, 30, 40]
        ids = ([1] if extra and i == 2 else []) + prompt + [50 + i, 60, 70, 80]
        n, k0 = len(ids), len(ids) - 5  # position k0 predicts the first of the 4 completion tokens
        mask = [0.0] * k0 + [1.0] * 4 + [0.0]
        logprobs = [-1.0] * n
        data.append(Datum(ModelInput.from_ints(ids), {"logprobs": logprobs, "mask": mask}))
        trainer.append(torch.full((n,), -1.0))
        prompts.append(prompt)
    return data, trainer, prompts


def test_a_list_of_datums_compares_model_input_and_names_an_extra_leading_token() -> None:
    data, trainer, prompts = datums()
    host = stats({"training_logprobs": trainer, "sampler_prompt_ids": prompts}, data).to_host()
    assert host.totals["n_prompt_datums_compared"] == 3 and host.totals["n_prompt_datums_differ"] == 0
    data, trainer, prompts = datums(extra=True)  # datum 2's trainer prompt begins with a second BOS
    found = decode_record(stats({"training_logprobs": trainer, "sampler_prompt_ids": prompts}, data).to_host()
                          .arrays["prompt_first"])
    assert found is not None and (found["datum"], found["position"], found["sampler_length"],
                                  found["trainer_length"]) == (2, 0, 4, 5)


def test_micro_batches_and_ranks_merge_to_the_first_differing_datum_of_the_step() -> None:
    clean = stats(*padded(1, batch=3))
    outputs, batch = padded(2, batch=4)
    outputs["sampler_prompt_ids"][2:, 20] = 9  # datums 2 and 3 of the second micro-batch only
    changed = stats(outputs, batch)
    for merged in [clean.merge(changed).to_host(), *(r.to_host() for r in reduce_in_threads([clean, changed]))]:
        assert merged.totals["n_prompt_datums_compared"] == 7 and merged.totals["n_prompt_datums_differ"] == 2
        found = decode_record(merged.arrays["prompt_first"])
        assert (found["datum"], found["position"]) == (5, 20)  # 3 + 2: the step's datum index
        assert found["sampler"][0] == 9 and found["trainer"][0] == batch["input_ids"][2, 20]
    earlier = stats(*padded(3, batch=3))
    outputs, batch = padded(3, batch=3)
    outputs["sampler_prompt_ids"][1, 4] = 9
    first = changed.merge(stats(outputs, batch)).to_host()  # both differ: the earlier datum's record, whole
    found = decode_record(first.arrays["prompt_first"])
    assert (found["datum"], found["position"], found["sampler"][0]) == (2, 20, 9)
    assert earlier.to_host().totals["n_prompt_datums_differ"] == 0


@pytest.mark.parametrize(("value", "error", "said"), [
    (torch.zeros(B, PROMPT), TypeError, "torch.float32 tensor"),
    (torch.zeros(B + 1, PROMPT, dtype=torch.long), ValueError, f"shape ({B + 1}, {PROMPT}); expected [{B}, P]"),
    (torch.cat([torch.ones(B, 3, dtype=torch.long), torch.full((B, 2), -1)], 1), ValueError,
     "row 0, position 3 is -1 after the prompt's first id at position 0 (row of 5)"),
    ([[1, 2]] * (B - 1), ValueError, f"holds {B - 1} prompts for a micro-batch of {B} datums"),
    ([[1, 2]] * (B - 1) + [[4, -3, 5]], ValueError, f"datum {B - 1}: position 1 of 3 is -3.0"),
    ([[1, 2]] * (B - 1) + [[4, 1.5]], ValueError, f"datum {B - 1}: position 1 of 2 is 1.5"),
    ([[1, 2]] * (B - 1) + ["abc"], TypeError, f"datum {B - 1}: expected a 1-D sequence of token ids, got str"),
    ("abc", TypeError, "is a str; expected one list of ids per datum"),
])
def test_sampler_prompt_ids_that_are_not_prompts_are_refused_where_they_are(value: Any, error: type, said: str
                                                                             ) -> None:
    outputs, batch = padded()
    outputs["sampler_prompt_ids"] = value
    with pytest.raises(error, match="'sampler_prompt_ids'") as raised:
        read_step(outputs, batch)
    assert said in str(raised.value)


def test_prompts_without_the_trainer_s_tokens_are_a_warning_and_not_compared() -> None:
    from loops_callbacks.run_warnings import RunWarnings

    outputs, batch = padded()
    del batch["input_ids"], batch["target_tokens"]
    with pytest.warns(UserWarning, match="neither 'input_ids' nor 'target_tokens': the prompts are not compared"):
        flat = read_step(outputs, batch, warnings=RunWarnings())
    assert DivergenceStats.from_batch(flat).to_host().totals["n_prompt_datums_compared"] == 0


def test_the_position_is_the_last_that_differs_whatever_the_prompts_lengths() -> None:
    outputs, batch = padded()
    prompts = outputs["sampler_prompt_ids"]
    prompts[:, 5], prompts[:, 12] = 7, 7
    assert diagnosis(stats(outputs, batch).to_host()).numbers["prompt_position"] == 12
    longer = torch.cat([torch.full((B, 3), 4), prompts], 1)  # 3 more system tokens: ids 3 further in
    outputs["sampler_prompt_ids"] = longer
    found = diagnosis(stats(outputs, batch).to_host())
    assert found.numbers["prompt_position"] == 15 and "the sampler's prompt has 33 tokens, the trainer's 30" in (
        found.message)


def test_a_list_of_datums_may_carry_each_prompt_in_its_loss_fn_inputs() -> None:
    data, trainer, prompts = datums(extra=True)
    for datum, prompt in zip(data, prompts):
        datum.loss_fn_inputs["sampler_prompt_ids"] = prompt
    host = stats({"training_logprobs": trainer}, data).to_host()
    assert (host.totals["n_prompt_datums_compared"], host.totals["n_prompt_datums_differ"]) == (3, 1)
    del data[1].loss_fn_inputs["sampler_prompt_ids"]
    with pytest.raises(ValueError, match=r"datum 1 has no loss_fn_inputs\['sampler_prompt_ids'\] \(datums 0, 2 have "
                                         r"one; 1 of 3 have none\)"):
        read_step({"training_logprobs": trainer}, data)


def test_a_batch_read_in_chunks_names_the_batch_s_datum(monkeypatch: pytest.MonkeyPatch) -> None:
    from loops_callbacks.divergence import statistics

    outputs, batch = padded()
    outputs["sampler_prompt_ids"][5:, 3] = 9
    whole = stats(outputs, batch).to_host()
    monkeypatch.setattr(statistics, "CHUNK_POSITIONS", 2 * T)  # datums 0-1, 2-3, ...: each chunk counts from 0
    chunked = stats(outputs, batch).to_host()
    for host in (whole, chunked):
        found = decode_record(host.arrays["prompt_first"])
        assert (found["datum"], found["position"], host.totals["n_prompt_datums_differ"]) == (5, 3, 3)


def test_the_prompt_is_named_before_any_statistical_rule_and_after_the_versions() -> None:
    from loops_callbacks.divergence.diagnosis import diagnose

    shifted = {"frac_d_zero": 0.0, "shift_ratio": 3e-8, "shift_direction": 1.0, "pearson": 0.1}
    prompt = ("in 1 of 1 compared datums; ...", {"prompt_position": 3.0})
    assert diagnose(shifted, n_tokens=900).cause == "shift"
    found = diagnose(shifted, n_tokens=900, prompt=prompt)
    assert (found.cause, found.confidence, found.is_observation) == ("prompt", 1.0, True)
    assert diagnose(shifted, n_tokens=10, prompt=prompt).cause == "prompt"  # too few tokens to weigh: still seen
    behind = shifted | {"lag_min": 2.0, "lag_max": 2.0}
    assert diagnose(behind, n_tokens=900, prompt=prompt).cause == "stale"
