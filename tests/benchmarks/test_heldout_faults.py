"""The held-out fault generator (benchmarks/heldout_faults.py) makes the faults it says it makes.

Each test builds a tiny trajectory (a few optimizer steps) and checks one fault's numbers against
what that fault must do to them, so a generator that quietly stopped seeding a fault would fail.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import heldout_faults as hf  # noqa: E402

STEPS, BATCH = 3, 8


@pytest.fixture(scope="module")
def trajectory() -> list[dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    return hf.trainer_trajectory("peaked", STEPS, pretrain_steps=3, seed=0)


def steps_of(name: str, trajectory: list[dict[str, torch.Tensor]]) -> list[dict]:
    return hf.generate_fault_steps("peaked", hf.FAULTS_BY_NAME[name], steps=STEPS, batch=BATCH, trajectory=trajectory)


def trainer_logits(step: dict, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = hf.new_model()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(step["input_ids"]).logits.float()


def test_the_generator_shares_no_code_with_the_package() -> None:
    tree = ast.parse((ROOT / "benchmarks" / "heldout_faults.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [name for name in imported if name.startswith("loops_callbacks")], imported


def test_rows_follow_the_monitor_contract(trajectory: list[dict[str, torch.Tensor]]) -> None:
    for step in steps_of("fp32 generate, raw", trajectory):
        assert step["logprobs"].shape == step["training_logprobs"].shape == step["mask"].shape
        assert torch.equal(step["target_tokens"][:, :-1], step["input_ids"][:, 1:])
        assert torch.equal(step["mask"].sum(1), torch.full((BATCH,), float(hf.COMPLETION)))
        active = step["mask"] > 0
        assert torch.equal(step["logprobs"][~active], torch.zeros(int((~active).sum())))
        # identical fp32 weights: generate's KV-cached logits match the full forward up to rounding
        assert torch.allclose(step["logprobs"][active], step["training_logprobs"][active], atol=1e-5)
        assert step["truth"] == "none"


def test_processed_logprobs_are_after_the_temperature(trajectory: list[dict[str, torch.Tensor]]) -> None:
    step = steps_of("temperature 0.7, processed", trajectory)[1]
    expected = (trainer_logits(step, trajectory[1]) / 0.7).log_softmax(-1)
    expected = expected.gather(-1, step["target_tokens"][..., None])[..., 0]
    active = step["mask"] > 0
    assert torch.allclose(step["logprobs"][active], expected[active], atol=1e-4)
    assert not torch.allclose(step["logprobs"][active], step["training_logprobs"][active], atol=1e-2)


def test_truncated_logprobs_are_renormalized_on_the_top_k(trajectory: list[dict[str, torch.Tensor]]) -> None:
    step = steps_of("top-k 8, processed", trajectory)[0]
    logits = trainer_logits(step, trajectory[0])
    kept = logits.topk(8, dim=-1)
    top = torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values).log_softmax(-1)
    expected = top.gather(-1, step["target_tokens"][..., None])[..., 0]
    active = step["mask"] > 0
    assert torch.allclose(step["logprobs"][active], expected[active], atol=1e-4)
    assert bool((step["logprobs"][active] >= step["training_logprobs"][active] - 1e-5).all())


def test_offsets_move_the_sampler_values(trajectory: list[dict[str, torch.Tensor]]) -> None:
    aligned = torch.tensor([[0.0, 0.0, -1.0, -2.0, -3.0, -4.0]])  # prompt positions hold 0.0
    late = hf._misalign(aligned, hf.FAULTS_BY_NAME["offset +2"], first=2)
    early = hf._misalign(aligned, hf.FAULTS_BY_NAME["offset -1"], first=2)
    left = hf._misalign(aligned, hf.FAULTS_BY_NAME["completion-only, left-aligned"], first=2)
    assert late.tolist() == [[0.0, 0.0, 0.0, 0.0, -1.0, -2.0]]
    assert early.tolist() == [[0.0, -1.0, -2.0, -3.0, -4.0, 0.0]]
    assert left.tolist() == [[-1.0, -2.0, -3.0, -4.0, 0.0, 0.0]]
    step = steps_of("offset +2", trajectory)[0]
    active = step["mask"] > 0
    assert not torch.allclose(step["logprobs"][active], step["training_logprobs"][active], atol=1e-2)


def test_stale_samplers_record_their_policy_version(trajectory: list[dict[str, torch.Tensor]]) -> None:
    steps = steps_of("stale: 2 steps behind", trajectory)
    assert [step["policy_version"].tolist() for step in steps] == [[0] * BATCH, [0] * BATCH, [0] * BATCH]
    assert [step["truth"] for step in steps] == ["none", "stale", "stale"]
    active = steps[0]["mask"] > 0
    assert torch.allclose(steps[0]["logprobs"][active], steps[0]["training_logprobs"][active], atol=1e-5)
    active = steps[2]["mask"] > 0
    assert not torch.allclose(steps[2]["logprobs"][active], steps[2]["training_logprobs"][active], atol=1e-3)
    mixed = steps_of("stale: per-datum lags 0-4", trajectory)[2]
    assert set(mixed["policy_version"].tolist()) <= {0, 1, 2} and len(set(mixed["policy_version"].tolist())) > 1


def test_dropout_and_a_stale_prefix_change_one_side(trajectory: list[dict[str, torch.Tensor]]) -> None:
    dropout = steps_of("dropout 0.1 in the trainer", trajectory)[0]
    assert dropout["trainer_training"] is True and dropout["dropout_p"] == 0.1
    active = dropout["mask"] > 0
    assert (dropout["training_logprobs"] - dropout["logprobs"])[active].abs().mean() > 1e-3
    prefix = steps_of("stale prefix KV cache (4 steps)", trajectory)
    assert [step["truth"] for step in prefix] == ["none", "stale", "stale"]
    gap = (prefix[2]["training_logprobs"] - prefix[2]["logprobs"])[prefix[2]["mask"] > 0].abs().mean()
    assert gap > 1e-3  # a synced fp32 sampler is ~1e-7 off (rounding of the KV-cached decoding)


def test_steps_are_cached_in_the_given_folder_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    faults = (hf.FAULTS_BY_NAME["bf16 sampler, raw"],)
    first = hf.cached_fault_steps("flat", steps=1, batch=4, pretrain_steps=1, cache_dir=tmp_path, faults=faults)
    assert [p.suffix for p in tmp_path.iterdir()] == [".pt"]

    def no_generation(*args: object, **kwargs: object) -> None:
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(hf, "generate_fault_steps", no_generation)
    again = hf.cached_fault_steps("flat", steps=1, batch=4, pretrain_steps=1, cache_dir=tmp_path, faults=faults)
    assert torch.equal(again["bf16 sampler, raw"][0]["logprobs"], first["bf16 sampler, raw"][0]["logprobs"])


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="variant must be one of"):
        hf.generate_fault_steps("spiky", hf.FAULTS[0], steps=1, batch=1)
    with pytest.raises(ValueError, match="steps and batch must be >= 1"):
        hf.generate_fault_steps("flat", hf.FAULTS[0], steps=0, batch=1)
