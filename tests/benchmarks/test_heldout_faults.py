"""The held-out fault generator (benchmarks/heldout_faults.py) makes the faults it says it makes.

Each test builds a tiny trajectory (a few optimizer steps) and checks one fault's numbers against
what that fault must do to them, so a generator that quietly stopped seeding a fault would fail.

Set 1 must stay the generator it was when the diagnosis' rules were designed on it (the code
before held-out sets existed, commit 42a5625): ``generate_fault_steps(variant, fault, steps=2,
batch=4, trajectory=...)`` on ``trainer_trajectory(variant, 2, pretrain_steps=3, seed=0)`` gives
the references below (``ORIGINAL_*``), taken where today's generator still gave that code's steps
bit for bit. They hold what every CPU gives: the integer parts and labels exactly (the draws of an
fp32 sampler; a bf16 sampler's prompts only, as another CPU's bf16 rounding can move a draw that
sits near a boundary), and an fp32 sampler's mean logprobs within float32 rounding. The cache keys' hashes of
the full-size run (12 steps, batch 128, 300 checkpoint steps) are the original's, so the cache
files written then are still read.
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
ORIGINAL_PEAKED = {  # fault: (integer_digest of its 2 steps, batch 4, on the trajectory's first 3 weights,
    # mean_logprobs of an fp32 sampler's steps)
    "fp32 generate, raw": ("b3d87cd3e7f8c192", (-4.5228924, -4.5228924)),
    "fp32 generate, T 0.7, raw": ("1408394d82538e76", (-4.5032190, -4.5032189)),
    "bf16 sampler, raw": ("8d497238fb72ae54", None),
    "bf16 sampler, processed": ("d91e10ad7d4f754b", None),
    "temperature 0.7, processed": ("88efe287f34d7f15", (-4.4444309, -4.4642915)),
    "temperature 1.3, processed": ("0d8a9bcbcb4668c0", (-4.5769340, -4.5884250)),
    "bf16 + temperature 1.3": ("fe7eadd35c6727a2", None),
    "top-k 8, processed": ("fc2ab377b582d65c", (-2.0240069, -3.9288298)),
    "top-p 0.8, processed": ("404397e95d476ab2", (-4.2422835, -4.4605557)),
    "offset +1": ("0372affa2e1bb263", (-4.3562341, -4.5406316)),
    "offset -1": ("682434292458c3f8", (-4.3222585, -4.5090262)),
    "offset +2": ("781557f15271e50f", (-4.1883877, -4.5628102)),
    "offset -2": ("89e1bc4a300b5a60", (-4.1441355, -4.5200039)),
    "offset +3": ("ffdc677026f7844f", (-3.9615566, -4.5199205)),
    "offset -3": ("78ecb07a61e00dfb", (-3.9415214, -4.5049234)),
    "completion-only, left-aligned": ("445b4af12c3df08d", (-2.8170764, -4.5147683)),
    "bf16 + offset +2": ("bae919e094d640d7", None),
    "template: extra BOS": ("e2a8ae76b48defbe", (-4.5316136, -4.5296253)),
    "template: another first token": ("d791873479ad6316", (-4.5245076, -4.5270115)),
    "stale: 2 steps behind": ("edc23e983a491464", (-4.5504603, -4.5493995)),
    "stale: 6 steps behind": ("67ab4c60bc094b76", (-4.5623520, -4.5535467)),
    "stale: per-datum lags 0-4": ("889243a388f5ca6c", (-4.5243735, -4.5217732)),
    "stale prefix KV cache (4 steps)": ("0e2688f9bcc8cccc", (-4.5702894, -4.5704350)),
    "dropout 0.1 in the trainer": ("f82d169c71bf7007", (-4.5346196, -4.5431373)),
    "dropout in both, bf16 sampler": ("8dec689a97a9da3d", None),
}
ORIGINAL_FLAT = {
    "fp32 generate, raw": ("f270b1bfdc40eb7c", (-4.5196330, -4.5196330)),
    "bf16 + offset +2": ("940386ead19bdf32", None),
    "template: another first token": ("31e115527a55e202", (-4.5164006, -4.5177615)),
    "stale prefix KV cache (4 steps)": ("cde9a09d42137491", (-4.5533223, -4.5528421)),
}
MEANS_WITHIN = 1e-5
"""Float32 rounding moves a token's logprob by a few 1e-6 at most between CPUs (2.4e-6 between ATen's
AVX2 and AVX-512 kernels, through the trajectory's Adam steps too; the means by 1e-7)."""
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


def integer_digest(steps: list[dict]) -> str:
    """The steps' integer parts and labels: every token with an fp32 sampler, a bf16 sampler's prompts."""
    h = hashlib.sha256()
    for step in steps:
        tokens = step["input_ids"]
        if step["sampler_dtype"] != "float32":
            tokens = tokens[:, : int(step["mask"][0].argmax()) + 1]
        for tensor in (tokens, step["mask"], step["policy_version"]):
            h.update(tensor.contiguous().numpy().tobytes())
        if step["sampler_dtype"] == "float32":
            h.update(step["target_tokens"].contiguous().numpy().tobytes())
        h.update(repr((step["truth"], step["trainer_training"], step["dropout_p"], step["sampler_dtype"])).encode())
    return h.hexdigest()[:16]


def mean_logprobs(steps: list[dict]) -> tuple[float, float] | None:
    """The sampler's and the trainer's mean logprob over the completions; None with a bf16 sampler."""
    if steps[0]["sampler_dtype"] != "float32":
        return None
    active = torch.cat([step["mask"].flatten() for step in steps]) > 0
    return tuple(
        torch.cat([step[key].flatten() for step in steps])[active].double().mean().item()
        for key in ("logprobs", "training_logprobs")
    )


def assert_the_original(got: dict[str, list[dict]], expected: dict[str, tuple]) -> None:
    assert list(got) == list(expected)
    assert {name: integer_digest(steps) for name, steps in got.items()} == {k: v[0] for k, v in expected.items()}
    for name, steps in got.items():
        means, original = mean_logprobs(steps), expected[name][1]
        assert (means is None) == (original is None), name
        if means is not None:
            assert means == pytest.approx(original, rel=0, abs=MEANS_WITHIN), name


def test_set_1_reproduces_the_original_generator(trajectory: list[dict[str, torch.Tensor]]) -> None:
    torch.set_num_threads(1)
    # a 3-step trajectory starts as a 2-step one
    two_steps = hf.trainer_trajectory(ORIGINAL, "peaked", 2, pretrain_steps=3)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(two_steps, trajectory[:3], strict=True) for k in a)
    assert [fault.name for fault in ORIGINAL.faults] == list(ORIGINAL_PEAKED)
    peaked = {
        fault.name: hf.generate_fault_steps(ORIGINAL, "peaked", fault, steps=2, batch=4, trajectory=trajectory)
        for fault in ORIGINAL.faults
    }
    assert_the_original(peaked, ORIGINAL_PEAKED)
    flat = hf.trainer_trajectory(ORIGINAL, "flat", 2, pretrain_steps=3)
    assert_the_original(
        {
            name: hf.generate_fault_steps(ORIGINAL, "flat", ORIGINAL.fault(name), steps=2, batch=4, trajectory=flat)
            for name in ORIGINAL_FLAT
        },
        ORIGINAL_FLAT,
    )


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
