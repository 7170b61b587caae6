"""The held-out fault generator (benchmarks/heldout_faults.py) makes the faults it says it makes.

Each test builds a tiny trajectory (a few optimizer steps) and checks one fault's numbers against
what that fault must do to them, so a generator that quietly stopped seeding a fault would fail.

Set 1 must stay the generator it was when the diagnosis' rules were designed on it: the digests
below (``ORIGINAL_*``) were computed by the code before held-out sets existed (commit 42a5625,
``generate_fault_steps(variant, fault, steps=2, batch=4, trajectory=...)`` on
``trainer_trajectory(variant, 2, pretrain_steps=3, seed=0)``, one torch thread), as were the cache
keys' hashes of the full-size run (12 steps, batch 128, 300 checkpoint steps), so the cache files
written then are still read.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import heldout_faults as hf  # noqa: E402

STEPS, BATCH = 3, 8
ORIGINAL, FRESH = hf.SETS[1], hf.SETS[2]
ORIGINAL_PEAKED = {  # fault: the digest of its 2 steps, batch 4, on the trajectory's first 3 weights
    'fp32 generate, raw': "5816b0b06121f565",
    'fp32 generate, T 0.7, raw': "c62cc92e6da31ad9",
    'bf16 sampler, raw': "40b5c0a958fceece",
    'bf16 sampler, processed': "8db3f635edd42b32",
    'temperature 0.7, processed': "76e40f63e5de32de",
    'temperature 1.3, processed': "7f59c002cdb97d2c",
    'bf16 + temperature 1.3': "0550e198c1ad5fbb",
    'top-k 8, processed': "942a140b414d4569",
    'top-p 0.8, processed': "91a051ce1bc42512",
    'offset +1': "990a495816b7ea1d",
    'offset -1': "363a06eabe35f15b",
    'offset +2': "b4164d8f4c727d1a",
    'offset -2': "ac4dcfc8a94a599b",
    'offset +3': "a0d9c44e04a8c5f6",
    'offset -3': "89ed50264f0fcb37",
    'completion-only, left-aligned': "fae055cb7251d46e",
    'bf16 + offset +2': "c4086eac95380248",
    'template: extra BOS': "f4b61ad0c13b4b78",
    'template: another first token': "f5398d2abc6df937",
    'stale: 2 steps behind': "c85ff1a5bbf1cc65",
    'stale: 6 steps behind': "301937adba1591b4",
    'stale: per-datum lags 0-4': "31e9d1a0875dabf2",
    'stale prefix KV cache (4 steps)': "e52b2aadfe32c8c2",
    'dropout 0.1 in the trainer': "f4358069c86b8979",
    'dropout in both, bf16 sampler': "d29dd32c510f3f42",
}
ORIGINAL_FLAT = {
    "fp32 generate, raw": "0e9971e170ed75b1",
    "bf16 + offset +2": "04ce2390bcee0257",
    "template: another first token": "0bef1b554782bd3e",
    "stale prefix KV cache (4 steps)": "7e953eb52e733e9b",
}
ORIGINAL_TRAJECTORIES = {"peaked": "9c3c2c413a2a1cd8", "flat": "f1b5c8fcf52cf595"}
ORIGINAL_CACHE_KEYS = {"flat": "89c9f6a770c9220d", "peaked": "1f620535522f9bc9"}


@pytest.fixture(scope="module")
def trajectory() -> list[dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    return hf.trainer_trajectory(ORIGINAL, "peaked", STEPS, pretrain_steps=3)


def steps_of(name: str, trajectory: list[dict[str, torch.Tensor]]) -> list[dict]:
    fault = hf.FAULTS_BY_NAME[name]
    return hf.generate_fault_steps(ORIGINAL, "peaked", fault, steps=STEPS, batch=BATCH, trajectory=trajectory)


def trainer_logits(step: dict, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = hf.new_model(ORIGINAL)
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(step["input_ids"]).logits.float()


def digest(steps: list[dict]) -> str:
    """The steps' tensors and labels, bit for bit (as the old code's digests were taken)."""
    h = hashlib.sha256()
    for step in steps:
        for key in ("logprobs", "training_logprobs", "mask", "input_ids", "target_tokens", "policy_version"):
            h.update(step[key].contiguous().numpy().tobytes())
        h.update(repr((step["truth"], step["trainer_training"], step["dropout_p"], step["sampler_dtype"])).encode())
    return h.hexdigest()[:16]


def weights_digest(weights: list[dict[str, torch.Tensor]]) -> str:
    return hashlib.sha256(b"".join(v.numpy().tobytes() for w in weights for v in w.values())).hexdigest()[:16]


def test_set_1_reproduces_the_original_generator_bit_for_bit(trajectory: list[dict[str, torch.Tensor]]) -> None:
    torch.set_num_threads(1)
    # a 3-step trajectory starts as a 2-step one
    assert weights_digest(trajectory[:3]) == ORIGINAL_TRAJECTORIES["peaked"]
    assert [fault.name for fault in ORIGINAL.faults] == list(ORIGINAL_PEAKED)
    got = {
        fault.name: digest(hf.generate_fault_steps(ORIGINAL, "peaked", fault, steps=2, batch=4, trajectory=trajectory))
        for fault in ORIGINAL.faults
    }
    assert got == ORIGINAL_PEAKED
    flat = hf.trainer_trajectory(ORIGINAL, "flat", 2, pretrain_steps=3)
    assert weights_digest(flat) == ORIGINAL_TRAJECTORIES["flat"]
    got = {
        name: digest(hf.generate_fault_steps(ORIGINAL, "flat", ORIGINAL.fault(name), steps=2, batch=4, trajectory=flat))
        for name in ORIGINAL_FLAT
    }
    assert got == ORIGINAL_FLAT


def test_set_1_keeps_its_cache_keys_and_set_2_has_its_own() -> None:
    for variant, expected in ORIGINAL_CACHE_KEYS.items():
        key = hf.cache_key(ORIGINAL, variant, steps=12, batch=128, pretrain_steps=300)
        assert hashlib.sha256(key.encode()).hexdigest()[:16] == expected, variant
    fresh = hf.cache_key(FRESH, "flat", steps=12, batch=128, pretrain_steps=300)
    assert fresh != hf.cache_key(ORIGINAL, "flat", steps=12, batch=128, pretrain_steps=300)
    # a fault differing only in a field added since set 1 was cached gets another key
    lighter = tuple(dataclasses.replace(f, dropout=0.05) if f.trainer_dropout else f for f in FRESH.faults)
    assert hf.cache_key(FRESH, "flat", steps=1, batch=1, pretrain_steps=1, faults=lighter) != hf.cache_key(
        FRESH, "flat", steps=1, batch=1, pretrain_steps=1
    )
    assert hf.cache_key(FRESH, "flat", steps=1, batch=1, pretrain_steps=1, faults=lighter) == hf.cache_key(
        FRESH, "flat", steps=1, batch=1, pretrain_steps=1, faults=lighter
    )


def test_set_2_differs_from_set_1_in_every_setting() -> None:
    original, fresh = ORIGINAL.generation_settings(), FRESH.generation_settings()
    assert FRESH.seed != ORIGINAL.seed
    assert [k for k in original if original[k] == fresh[k]] == ["n_head"]  # 4 heads of other widths (64, 96)
    assert FRESH.monitor_steps >= 14  # the 10-steps-behind fault is stale on most steps
    set_1 = {dataclasses.replace(f, name="") for f in ORIGINAL.faults}
    repeated = [f.name for f in FRESH.faults if dataclasses.replace(f, name="") in set_1]
    # the healthy engines (fp32 raw, bf16 at temperature 1), the one-position shift and the one BOS fault
    assert repeated == ["fp32 generate, raw", "bf16 sampler, processed", "offset -1", "template: extra BOS"]


def test_set_3_differs_from_sets_1_and_2_in_every_generation_setting() -> None:
    third = hf.SETS[3]
    settings = third.generation_settings()
    for earlier in (ORIGINAL, FRESH):
        before = earlier.generation_settings()
        assert third.seed != earlier.seed
        assert [k for k in before if before[k] == settings[k]] == ["n_head"], earlier.name
    seen = {dataclasses.replace(f, name="") for f in (*ORIGINAL.faults, *FRESH.faults)}
    repeated = [f.name for f in third.faults if dataclasses.replace(f, name="") in seen]
    # the healthy engines and five fault settings of set 1, on another model, chain and seed
    assert repeated == ["fp32 generate, raw", "bf16 sampler, raw", "bf16 + offset +2", "offset -3",
                        "completion-only, left-aligned", "template: extra BOS", "dropout 0.1 in the trainer"]


@pytest.mark.parametrize("number", [2, 3])
def test_every_fault_of_sets_2_and_3_makes_steps_of_the_set_shapes(number: int) -> None:
    torch.set_num_threads(1)
    heldout_set = hf.SETS[number]
    weights = hf.trainer_trajectory(heldout_set, "flat", 2, pretrain_steps=1)
    assert weights[0]["transformer.wte.weight"].shape == (heldout_set.vocab, heldout_set.n_embd)
    assert sum(1 for k in weights[0] if k.endswith("attn.c_attn.weight")) == heldout_set.n_layer
    for fault in heldout_set.faults:
        steps = hf.generate_fault_steps(heldout_set, "flat", fault, steps=2, batch=2, trajectory=weights)
        for step in steps:
            width = step["input_ids"].shape[1]
            assert width + 1 - heldout_set.completion in heldout_set.prompt_lengths, fault.name
            assert step["logprobs"].shape == step["training_logprobs"].shape == step["mask"].shape == (2, width)
            assert torch.equal(step["mask"].sum(1), torch.full((2,), float(heldout_set.completion))), fault.name
            assert int(step["input_ids"].max()) < heldout_set.vocab and step["dropout_p"] == fault.dropout
            assert step["sampler_dtype"] == fault.sampler_dtype and step["trainer_training"] == fault.trainer_dropout
        assert [s["truth"] for s in steps] == [("none" if fault.cause == "stale" else fault.cause), fault.cause]


def test_a_token_inserted_after_bos_changes_only_the_sampler_side() -> None:
    torch.set_num_threads(1)
    fault = FRESH.fault("template: a token inserted after BOS")
    prompts = torch.tensor([[0, 5, 6], [0, 7, 8]])
    assert hf.sampler_prompt(FRESH, prompts, fault).tolist() == [[0, 127, 5, 6], [0, 127, 7, 8]]
    other = FRESH.fault("template: another first token")
    assert hf.sampler_prompt(FRESH, prompts, other).tolist() == [[64, 5, 6], [64, 7, 8]]
    assert prompts.tolist() == [[0, 5, 6], [0, 7, 8]]  # not modified
    weights = hf.trainer_trajectory(FRESH, "peaked", 1, pretrain_steps=1)
    step = hf.generate_fault_steps(FRESH, "peaked", fault, steps=1, batch=4, trajectory=weights)[0]
    model = hf.new_model(FRESH)
    model.load_state_dict(weights[0])
    first = int(step["mask"][0].argmax())  # predicts the first sampled token; the prompt is first + 1 tokens
    full = torch.cat([step["input_ids"], step["target_tokens"][:, -1:]], 1)
    with torch.no_grad():
        trainer = model(full[:, :-1]).logits.log_softmax(-1)
        inserted = hf.sampler_prompt(FRESH, full, fault)
        sampler = model(inserted[:, :-1]).logits.log_softmax(-1)[:, 1:]  # one position later
    targets = step["target_tokens"]
    trainer = trainer.gather(-1, targets[..., None])[..., 0][:, first:]
    sampler = sampler.gather(-1, targets[..., None])[..., 0][:, first:]
    assert torch.allclose(step["training_logprobs"][:, first:], trainer, atol=1e-5)  # the prompt as it is
    assert torch.allclose(step["logprobs"][:, first:], sampler, atol=1e-4)  # the prompt with the marker
    assert (step["logprobs"] - step["training_logprobs"])[:, first:].abs().max() > 1e-3


def test_the_generator_shares_no_code_with_the_package() -> None:
    tree = ast.parse((ROOT / "benchmarks" / "heldout_faults.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert imported and not [name for name in imported if name.startswith("loops_callbacks")], imported


def test_rows_follow_the_monitor_contract(trajectory: list[dict[str, torch.Tensor]]) -> None:
    for step in steps_of("fp32 generate, raw", trajectory):
        assert step["logprobs"].shape == step["training_logprobs"].shape == step["mask"].shape
        assert torch.equal(step["target_tokens"][:, :-1], step["input_ids"][:, 1:])
        assert torch.equal(step["mask"].sum(1), torch.full((BATCH,), float(ORIGINAL.completion)))
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
    tiny = {"steps": 1, "batch": 4, "pretrain_steps": 1, "cache_dir": tmp_path, "faults": faults}
    first = hf.cached_fault_steps(ORIGINAL, "flat", **tiny)
    assert [p.suffix for p in tmp_path.iterdir()] == [".pt"]

    def no_generation(*args: object, **kwargs: object) -> None:
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(hf, "generate_fault_steps", no_generation)
    again = hf.cached_fault_steps(ORIGINAL, "flat", **tiny)
    assert torch.equal(again["bf16 sampler, raw"][0]["logprobs"], first["bf16 sampler, raw"][0]["logprobs"])


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="variant must be one of"):
        hf.generate_fault_steps(ORIGINAL, "spiky", hf.FAULTS[0], steps=1, batch=1)
    with pytest.raises(ValueError, match="steps and batch must be >= 1"):
        hf.generate_fault_steps(ORIGINAL, "flat", hf.FAULTS[0], steps=0, batch=1)
    with pytest.raises(ValueError, match="template_token 128 in \\[0, vocab 128\\)"):
        marker = hf.Fault("marker", "template", template="inserted_token", template_token=128)
        dataclasses.replace(FRESH, faults=(marker,))
    with pytest.raises(ValueError, match="must fit 64 positions"):
        dataclasses.replace(FRESH, completion=60)
    with pytest.raises(ValueError, match="has no fault 'offset \\+9'"):
        FRESH.fault("offset +9")
