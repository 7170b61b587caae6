"""RLPolicyModule: the output contract, the action mask, sampler syncing, precision, resume, learning."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from jsonargparse import ArgumentParser
from jsonargparse.typing import PositiveInt

from loops_callbacks.demo.data import PromptDataModule
from loops_callbacks.demo.model import token_logprobs
from loops_callbacks.demo.rl import RLPolicyModule, policy_gradient_loss
from tests.helpers import quiet_trainer

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:You are trying to `self.log\\(\\)`",  # training_step called without a Trainer
        "ignore:.*does not have many workers",
        "ignore:.*LeafSpec",
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]




class _Recorder(lightning.Callback):
    """Per micro-batch: when the sampler was last synced, and the largest |trainer - sampler| gap."""

    def __init__(self) -> None:
        self.synced_at: list[int | None] = []
        self.max_gap: list[float] = []
        self.outputs: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        active = outputs["mask"] > 0
        gap = (outputs["training_logprobs"].detach().double() - outputs["logprobs"].double())[active]
        self.synced_at.append(module.sampler_synced_at_step)
        self.max_gap.append(gap.abs().max().item())
        self.outputs.append(outputs)


def _gap(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return (out["training_logprobs"].detach() - out["logprobs"])[out["mask"] > 0]


def test_training_step_output_contract() -> None:
    torch.manual_seed(0)
    module = RLPolicyModule(num_digits=3, group_size=4)
    prompts = module.task.sample_prompts(5)
    out = module.training_step({"prompt_ids": prompts}, 0)
    batch, length = 5 * 4, 5 + 4 - 1  # B = prompts x group_size; T = prompt + completion - 1
    assert set(out) == {"loss", "training_logprobs", "logprobs", "mask", "advantages", "input_ids", "target_tokens"}
    assert out["loss"].shape == () and out["loss"].requires_grad
    assert out["training_logprobs"].shape == (batch, length) and out["training_logprobs"].dtype == torch.float32
    assert out["training_logprobs"].requires_grad  # the callback detaches
    assert out["logprobs"].shape == (batch, length) and out["logprobs"].dtype in (torch.float32, torch.float64)
    assert not out["logprobs"].requires_grad
    assert out["mask"].shape == (batch, length) and out["mask"].dtype == torch.float32
    assert out["advantages"].shape in ((batch,), (batch, length))
    assert out["input_ids"].shape == out["target_tokens"].shape == (batch, length)
    assert out["input_ids"].dtype == out["target_tokens"].dtype == torch.int64
    # input_ids = sequence[:-1], target_tokens = sequence[1:]; each group shares its prompt
    assert torch.equal(out["input_ids"][:, 1:], out["target_tokens"][:, :-1])
    assert torch.equal(out["input_ids"][:, :5], prompts.repeat_interleave(4, dim=0))
    assert math.isfinite(out["loss"].item())
    # the advantages are centred within each group
    torch.testing.assert_close(out["advantages"].view(5, 4).sum(1), torch.zeros(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(module(out["input_ids"]), module.policy(out["input_ids"]))


def test_mask_rewards_advantages_and_loss_on_hand_made_completions(monkeypatch: pytest.MonkeyPatch) -> None:
    module = RLPolicyModule(num_digits=3, group_size=3)
    tok = module.tokenizer
    eos, pad = tok.eos_id, tok.pad_id
    prompts = torch.tensor([[tok.bos_id, *tok.encode("012=")]])
    completions = torch.tensor(
        [
            tok.encode("210") + [eos],  # exact: reward 1
            tok.encode("2") + [eos, pad, pad],  # stops early: reward 1/4
            tok.encode("1111"),  # no <eos>: reward 1/4 (the second digit is right)
        ]
    )
    monkeypatch.setattr(module, "sample", lambda prompt_ids, repeats=1: completions)
    module.sync_sampler()
    out = module.training_step({"prompt_ids": prompts}, 0)
    # prompt tokens are predicted at positions 0..3, the completion at 4..7
    assert out["mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]]
    assert out["target_tokens"][:, 4:].tolist() == completions.tolist()
    torch.testing.assert_close(out["advantages"], torch.tensor([0.5, -0.25, -0.25]))
    assert (out["logprobs"][out["mask"] == 0] == 0).all()
    # synced float32 sampler: every importance ratio is 1, so loss = -sum(adv * n_tokens) / n_tokens
    expected = -(0.5 * 4 - 0.25 * 2 - 0.25 * 4) / 10
    assert out["loss"].item() == pytest.approx(expected, abs=1e-6)


def test_sampler_gap_zero_after_sync_in_float32_and_a_small_precision_gap_in_bfloat16() -> None:
    gaps = {}
    for precision in ("float32", "bfloat16"):
        torch.manual_seed(0)
        module = RLPolicyModule(num_digits=3, group_size=4, sampler_precision=precision)
        assert next(module.sampler.parameters()).dtype == getattr(torch, precision)
        assert module.sampler.compute_dtype == torch.float32
        module.sync_sampler()
        gaps[precision] = _gap(module.training_step({"prompt_ids": module.task.sample_prompts(8)}, 0)).double()
    assert torch.equal(gaps["float32"], torch.zeros_like(gaps["float32"]))  # the same numbers, bit for bit
    gap = gaps["bfloat16"]
    k3 = (gap.exp() - 1 - gap).mean().item()
    assert gap.abs().mean() > 1e-4 and gap.abs().max() < 0.05, gap.abs().max()
    assert 1e-8 < k3 < 1e-4, k3  # the rounding gap of a bf16 engine: real, and far below a broken sync


def test_bf16_sampler_rounds_weights_at_sync_and_computes_in_float32() -> None:
    torch.manual_seed(0)
    module = RLPolicyModule(num_digits=3, group_size=2, sampler_precision="bfloat16")
    with torch.no_grad():
        for parameter in module.policy.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    module.sync_sampler()
    for name, weight in module.sampler.state_dict().items():
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, module.policy.state_dict()[name].bfloat16()), name
    input_ids = module.task.sample_prompts(4)
    logits = module.sampler(input_ids)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.bfloat16().float())
    # the same weights in a native bf16 forward give (up to summation order) the same logprobs
    native = copy.deepcopy(module.sampler)
    native.compute_dtype = None
    targets = torch.randint(0, module.tokenizer.vocab_size, input_ids.shape)
    emulated_lp, native_lp = token_logprobs(logits, targets), token_logprobs(native(input_ids), targets)
    policy_lp = token_logprobs(module.policy(input_ids), targets).detach()
    assert (emulated_lp - native_lp).abs().mean() < (policy_lp - native_lp).abs().mean() / 100


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_cached_shared_prompt_sampling_picks_what_full_forwards_pick(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    module = RLPolicyModule(num_digits=3, group_size=3, sampler_precision=precision)
    with torch.no_grad():
        for parameter in module.policy.parameters():
            parameter.normal_(0.0, 0.3)  # peaked, varied distributions
    module.sync_sampler()
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples: probs.argmax(-1, keepdim=True))
    prompts = module.task.sample_prompts(5)
    sampled = module.sample(prompts, repeats=3)
    # greedy decoding the slow way: the whole sequence through the sampler for every new token
    sequences = prompts.repeat_interleave(3, dim=0)
    for _ in range(module.task.max_new_tokens):
        sequences = torch.cat([sequences, module.sampler(sequences)[:, -1:].argmax(-1)], dim=1)
    expected = sequences[:, prompts.shape[1] :]
    eos, pad = module.tokenizer.eos_id, module.tokenizer.pad_id
    after_eos = (expected == eos).long().cumsum(1) - (expected == eos).long() > 0
    assert torch.equal(sampled, expected.masked_fill(after_eos, pad))
    assert sampled.shape == (15, module.task.max_new_tokens)


def test_sampler_receives_weights_every_sync_every_steps() -> None:
    torch.manual_seed(0)
    recorder = _Recorder()
    module = RLPolicyModule(num_digits=2, group_size=2, d_model=32, sync_every=2)
    quiet_trainer(max_steps=5, callbacks=[recorder]).fit(module, PromptDataModule(num_digits=2, batch_size=4))
    assert recorder.synced_at == [0, 0, 2, 2, 4]
    fresh = [gap <= 1e-6 for gap in recorder.max_gap]
    assert fresh == [True, False, True, False, True], recorder.max_gap


def test_stale_sampler_never_syncs_and_drifts() -> None:
    torch.manual_seed(0)
    recorder = _Recorder()
    module = RLPolicyModule(num_digits=2, group_size=2, d_model=32, sync_every=None)
    quiet_trainer(max_steps=4, callbacks=[recorder]).fit(module, PromptDataModule(num_digits=2, batch_size=4))
    assert recorder.synced_at == [0, 0, 0, 0]
    assert recorder.max_gap[0] <= 1e-6 and min(recorder.max_gap[1:]) > 1e-2


def test_bf16_mixed_with_gradient_accumulation() -> None:
    torch.manual_seed(0)
    recorder = _Recorder()
    module = RLPolicyModule(num_digits=2, group_size=2, d_model=32, sampler_precision="bfloat16")
    trainer = quiet_trainer(max_steps=3, precision="bf16-mixed", accumulate_grad_batches=2, callbacks=[recorder])
    trainer.fit(module, PromptDataModule(num_digits=2, batch_size=4))
    assert trainer.global_step == 3 and len(recorder.outputs) == 6
    assert recorder.synced_at == [0, 0, 1, 1, 2, 2]  # syncs count optimizer steps, not micro-batches
    for out in recorder.outputs:
        assert math.isfinite(out["loss"].item())
        assert out["training_logprobs"].dtype == out["logprobs"].dtype == torch.float32
    assert {"train/reward", "train/loss"} <= set(trainer.callback_metrics)


def test_resume_keeps_the_sampler_and_its_sync_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = RLPolicyModule(num_digits=2, group_size=2, d_model=32, sync_every=2)
    first = quiet_trainer(max_steps=3)
    first.fit(module, PromptDataModule(num_digits=2, batch_size=4))
    path = tmp_path / "rl.ckpt"
    first.save_checkpoint(path)
    stale = {k: v.clone() for k, v in module.sampler.state_dict().items()}
    assert module.sampler_synced_at_step == 2  # synced before step 2; step 3 would sync before step 4

    reloaded = RLPolicyModule.load_from_checkpoint(path)
    assert reloaded.sampler_synced_at_step == 2 and reloaded.hparams.sync_every == 2
    for key, value in reloaded.sampler.state_dict().items():
        assert torch.equal(value, stale[key]), key

    recorder = _Recorder()
    resumed = RLPolicyModule(num_digits=2, group_size=2, d_model=32, sync_every=2)
    datamodule = PromptDataModule(num_digits=2, batch_size=4)
    quiet_trainer(max_steps=5, callbacks=[recorder]).fit(resumed, datamodule, ckpt_path=path)
    # step 3 still samples with the sampler of step 2 (as an uninterrupted run would); step 4 syncs
    assert recorder.synced_at == [2, 4]
    assert recorder.max_gap[0] > 1e-3 and recorder.max_gap[1] <= 1e-6


def test_arguments_are_validated_by_the_parser_and_the_constructor() -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(RLPolicyModule, "model")
    assert parser.parse_args(["--model.sync_every=null"]).model.sync_every is None
    assert parser.parse_args(["--model.sync_every=3"]).model.sync_every == 3
    for bad in ("--model.sync_every=0", "--model.sampler_precision=float16", "--model.group_size=0"):
        with pytest.raises(Exception, match="sync_every|sampler_precision|group_size"):
            parser.parse_args([bad])
    with pytest.raises(ValueError, match=r"sync_every \(None: never sync\) must be an int >= 1 or None, got 0"):
        RLPolicyModule(sync_every=0)
    with pytest.raises(ValueError, match="group_size .*must be an int >= 2, got 1"):
        RLPolicyModule(group_size=PositiveInt(1))
    with pytest.raises(ValueError, match="sampler_precision.*'float16'"):
        RLPolicyModule(sampler_precision="float16")  # type: ignore[arg-type]
    module = RLPolicyModule(num_digits=3)
    with pytest.raises(ValueError, match=r"\[P, 5\], got \(2, 6\)"):
        module.training_step({"prompt_ids": torch.ones(2, 6, dtype=torch.long)}, 0)


def _mean_reward(module: RLPolicyModule, prompts: torch.Tensor) -> float:
    module.sync_sampler()
    completions = module.sample(prompts)
    rewards = [module.task.reward(p, c) for p, c in zip(prompts.tolist(), completions.tolist())]
    return sum(rewards) / len(rewards)


def test_reward_rises_in_a_short_run() -> None:
    lightning.seed_everything(0, verbose=False)
    module = RLPolicyModule(num_digits=3, num_symbols=5, group_size=8)
    held_out = module.task.sample_prompts(128, torch.Generator().manual_seed(123))
    before = _mean_reward(module, held_out)
    quiet_trainer(max_steps=130).fit(module, PromptDataModule(num_digits=3, num_symbols=5, batch_size=8))
    after = _mean_reward(module, held_out)
    assert before < 0.25 and after > 0.7, (before, after)


def _loss_and_grads(module: RLPolicyModule, tensors: dict[str, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    module.zero_grad()
    training_logprobs = token_logprobs(module(tensors["input_ids"]), tensors["target_tokens"])
    loss = policy_gradient_loss(training_logprobs, tensors["logprobs"], tensors["mask"], tensors["advantages"],
                                module.correction)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]


def test_a_correction_replaces_the_importance_ratio_in_the_loss() -> None:
    """A truncation that never binds gives Loops' loss and gradient; a mask that drops everything gives none."""
    torch.manual_seed(0)
    plain = RLPolicyModule(num_digits=2, group_size=2, sync_every=None)
    out = plain.training_step({"prompt_ids": plain.task.sample_prompts(3)}, 0)
    tensors = {key: out[key].detach() for key in ("input_ids", "target_tokens", "logprobs", "mask", "advantages")}
    with torch.no_grad():  # a sampler that differs from the policy, so the ratio is not 1
        tensors["logprobs"] = (tensors["logprobs"] - 0.3 * tensors["mask"]).clone()
    loss, grads = _loss_and_grads(plain, tensors)

    loose = RLPolicyModule(num_digits=2, group_size=2, sync_every=None, correction="token_truncate:1e9")
    loose.load_state_dict(plain.state_dict())
    loose_loss, loose_grads = _loss_and_grads(loose, tensors)
    assert loose_loss == pytest.approx(loss, rel=1e-6)
    for grad, loose_grad in zip(grads, loose_grads):
        torch.testing.assert_close(loose_grad, grad, rtol=1e-5, atol=1e-7)

    tight = RLPolicyModule(num_digits=2, group_size=2, sync_every=None, correction="token_truncate:1.0")
    tight.load_state_dict(plain.state_dict())
    tight_loss, _ = _loss_and_grads(tight, tensors)
    assert tight_loss != pytest.approx(loss, rel=1e-3)  # e^0.3 > 1 is clipped to 1

    dropped = RLPolicyModule(num_digits=2, group_size=2, sync_every=None, correction="token_mask:1.1")
    dropped.load_state_dict(plain.state_dict())
    dropped_loss, dropped_grads = _loss_and_grads(dropped, tensors)
    assert dropped_loss == 0.0 and all(float(g.abs().max()) == 0.0 for g in dropped_grads)


def test_an_unknown_correction_is_refused_when_the_module_is_built() -> None:
    with pytest.raises(ValueError, match="no_such_method"):
        RLPolicyModule(num_digits=2, group_size=2, correction="no_such_method")
