"""DPOPolicyModule: the loss and metrics against a hand computation, batch checks, and learning."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader

from loops_callbacks.data import DPOPairDataset, collate_dpo_pairs, dpo_pair_datums
from loops_callbacks.demo.data import make_preference_pairs
from loops_callbacks.demo.dpo import DPOPolicyModule, dpo_loss
from loops_callbacks.demo.tasks import ReverseDigitsTask
from loops_callbacks.helpers.datum import attach_reference_logprobs
from loops_callbacks.reference.clients import TorchSamplingClient
from tests.helpers import quiet_trainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:You are trying to `self.log\\(\\)`",
    "ignore:.*does not have many workers",
    "ignore:.*LeafSpec",
)

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_torch_thread")




def _hand_made_batch() -> dict[str, torch.Tensor]:
    # Two pairs, prompt <bos> d (2 tokens), rows interleaved chosen/rejected, right-padded with 0.
    # Position k belongs to the token predicted at k; the last real position predicts nothing.
    return {
        "input_ids": torch.tensor([[1, 4, 5, 2, 0], [1, 4, 6, 7, 2], [1, 8, 9, 2, 0], [1, 8, 3, 2, 0]]),
        "target_tokens": torch.tensor([[4, 5, 2, 0, 0], [4, 6, 7, 2, 0], [8, 9, 2, 0, 0], [8, 3, 2, 0, 0]]),
        "weights": torch.tensor([[0.0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 1, 1, 0, 0]]),
        "ref_logprobs": torch.tensor(
            [
                [NAN, -2.0, -1.5, NAN, NAN],
                [NAN, -2.5, -2.0, -1.0, NAN],
                [NAN, -3.0, -0.5, NAN, NAN],
                [NAN, -1.0, -1.0, NAN, NAN],
            ]
        ),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]),
    }


def _by_hand(module: DPOPolicyModule, batch: dict[str, torch.Tensor], beta: float) -> dict[str, float]:
    """The DPO numbers in plain Python, scoring each response token from its own unpadded prefix."""
    rewards = []
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):
            policy = reference = 0.0
            for k, weight in enumerate(batch["weights"][row].tolist()):
                if weight:
                    logits = module(batch["input_ids"][row : row + 1, : k + 1])[0, k]
                    policy += weight * logits.log_softmax(-1)[batch["target_tokens"][row, k]].item()
                    reference += weight * batch["ref_logprobs"][row, k].item()
            rewards.append(beta * (policy - reference))
    margins = [rewards[i] - rewards[i + 1] for i in range(0, len(rewards), 2)]
    return {
        "dpo_loss": sum(math.log1p(math.exp(-m)) for m in margins) / len(margins),
        "dpo_accuracy": sum(m > 0 for m in margins) / len(margins),
        "dpo_margin": sum(margins) / len(margins),
        "chosen_reward": sum(rewards[0::2]) / len(margins),
        "rejected_reward": sum(rewards[1::2]) / len(margins),
    }


def test_loss_and_metrics_match_a_hand_computation() -> None:
    torch.manual_seed(0)
    module = DPOPolicyModule(d_model=32, n_layers=1, n_heads=2, beta=0.5)
    batch = _hand_made_batch()
    expected = _by_hand(module, batch, beta=0.5)

    loss = module.training_step(batch, 0)
    assert loss.item() == pytest.approx(expected["dpo_loss"], abs=1e-5)
    _, metrics = dpo_loss(module.policy_logprobs(batch), batch["ref_logprobs"], batch["weights"], beta=0.5)
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-5), name

    # the same numbers reach the logger (logged before the optimizer step)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, DataLoader([batch], batch_size=None))
    for name, value in expected.items():
        assert trainer.callback_metrics[f"train/{name}"].item() == pytest.approx(value, abs=1e-5), name


def test_dpo_loss_on_numbers() -> None:
    # chosen sums to -2, rejected to -4, the reference to -3 for both: rewards 0.5 * (+1) and 0.5 * (-1)
    policy = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]])
    loss, metrics = dpo_loss(policy, torch.full((2, 2), -1.5), torch.ones(2, 2), beta=0.5)
    assert metrics["chosen_reward"].item() == pytest.approx(0.5)
    assert metrics["rejected_reward"].item() == pytest.approx(-0.5)
    assert metrics["dpo_margin"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)))
    assert metrics["dpo_accuracy"].item() == 1.0
    # a zero margin is not a win
    _, metrics = dpo_loss(policy, policy, torch.ones(2, 2), beta=0.5)
    assert metrics["dpo_accuracy"].item() == 0.0 and metrics["dpo_loss"].item() == pytest.approx(math.log(2))


def test_missing_reference_logprobs_say_how_to_attach_them() -> None:
    batch = _hand_made_batch()
    del batch["ref_logprobs"]
    with pytest.raises(ValueError, match="no 'ref_logprobs'.*not attached.*attach_reference_logprobs"):
        DPOPolicyModule(d_model=16, n_layers=1, n_heads=2).training_step(batch, 0)


def test_malformed_batches_are_named() -> None:
    module = DPOPolicyModule(d_model=16, n_layers=1, n_heads=2)
    batch = _hand_made_batch()
    with pytest.raises(ValueError, match="odd number of rows: 3"):
        module.training_step({k: v[:3] for k, v in batch.items()}, 0)
    with pytest.raises(ValueError, match="one \\[2P, T\\] shape"):
        module.training_step({**batch, "weights": batch["weights"][:, :4]}, 0)
    with pytest.raises(ValueError, match="beta must be a positive number, got 0"):
        DPOPolicyModule(beta=0)


def _scored_pairs(pairs: list, reference: TorchSamplingClient) -> DPOPairDataset:
    datums = [datum for chosen, rejected, k in pairs for datum in dpo_pair_datums(chosen, rejected, k)]
    return DPOPairDataset(attach_reference_logprobs(datums, reference))


def test_accuracy_rises_on_the_toy_pairs() -> None:
    torch.manual_seed(0)
    task = ReverseDigitsTask(num_digits=3, num_symbols=5)
    module = DPOPolicyModule(d_model=64, max_seq_len=task.prompt_length + task.max_new_tokens, beta=0.5)
    reference = TorchSamplingClient.snapshot(module)  # a frozen copy of the initial policy
    train = _scored_pairs(make_preference_pairs(task, 512, seed=1), reference)
    held_out = collate_dpo_pairs(list(_scored_pairs(make_preference_pairs(task, 256, seed=2), reference)))

    def metrics() -> dict[str, float]:
        with torch.no_grad():
            policy = module.policy_logprobs(held_out)
            _, values = dpo_loss(policy, held_out["ref_logprobs"], held_out["weights"], module.beta)
        return {name: value.item() for name, value in values.items()}

    before = metrics()
    assert abs(before["dpo_margin"]) < 1e-4  # the policy is still the reference
    quiet_trainer(max_steps=80).fit(module, DataLoader(train, batch_size=32, collate_fn=collate_dpo_pairs))
    after = metrics()
    assert after["dpo_accuracy"] > 0.85 and after["dpo_margin"] > 0.5, after
