"""ReverseDigitsTask: prompts, targets and the partial-credit reward on hand-made examples."""

from __future__ import annotations

import pytest
import torch

from loops_callbacks.demo.tasks import ReverseDigitsTask

TASK = ReverseDigitsTask(num_digits=4)
TOK = TASK.tokenizer
PROMPT = [TOK.bos_id, *TOK.encode("1234=")]
EOS = TOK.eos_id


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (TOK.encode("4321") + [EOS], 1.0),  # exact
        (TOK.encode("4300") + [EOS], 3 / 5),  # two digits wrong
        (TOK.encode("43") + [EOS], 2 / 5),  # stopped early: the <eos> is in a digit's place
        (TOK.encode("4321"), 4 / 5),  # no <eos>
        (TOK.encode("4321") + [EOS, 5, 6], 1.0),  # anything after <eos> is ignored
        (TOK.encode("1234") + [EOS], 1 / 5),  # copied instead of reversed
        ([EOS], 0.0),
        ([], 0.0),
        (TOK.encode("43219") + [EOS], 4 / 5),  # too long: the fifth token should have been <eos>
    ],
)
def test_reward_partial_credit(completion: list[int], expected: float) -> None:
    assert TASK.reward(PROMPT, completion) == pytest.approx(expected)


def test_target_and_sizes() -> None:
    assert TOK.decode(TASK.target(PROMPT)) == "4321<eos>"
    assert (TASK.prompt_length, TASK.max_new_tokens) == (6, 5)
    with pytest.raises(ValueError, match="6 tokens, got 4"):
        TASK.target(PROMPT[:4])


def test_sample_prompts_use_the_first_symbols_only() -> None:
    task = ReverseDigitsTask(num_digits=5, num_symbols=3)
    prompts = task.sample_prompts(200, torch.Generator().manual_seed(0))
    assert prompts.shape == (200, 7) and prompts.dtype == torch.long
    texts = [task.tokenizer.decode(row) for row in prompts.tolist()]
    assert all(t.startswith("<bos>") and t.endswith("=") for t in texts)
    digits = {c for t in texts for c in t[len("<bos>") : -1]}
    assert digits == {"0", "1", "2"}
    # rewards of random completions stay in [0, 1]
    for row in prompts[:20].tolist():
        completion = torch.randint(0, task.tokenizer.vocab_size, (8,)).tolist()
        assert 0.0 <= task.reward(row, completion) <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"num_digits": 0}, "num_digits.*0"), ({"num_symbols": 11}, "num_symbols.*11")]
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReverseDigitsTask(**kwargs)


def test_a_wrong_type_is_a_type_error_naming_the_argument() -> None:
    from loops_callbacks.demo.data import make_preference_pairs
    from loops_callbacks.demo.sampler_faults import SamplerFaults

    with pytest.raises(TypeError, match="num_digits must be an int >= 1, got '4'"):
        ReverseDigitsTask(num_digits="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="logprob_shift must be -1, 0 or 1, got 0.5"):
        SamplerFaults(logprob_shift=0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_pairs must be an int >= 0, got 1.5"):
        make_preference_pairs(TASK, 1.5)  # type: ignore[arg-type]
