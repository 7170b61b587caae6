"""Datums in Tinker's convention are told apart from Loops ones, refused with the fix, and converted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loops_callbacks.conventions import from_tinker_convention, weighted_last_positions
from loops_callbacks.data import DPODataModule, check_dpo_pairs, dpo_pair_datums
from loops_callbacks.fields import field_to_tensor
from loops_callbacks.types import Datum, TensorData
from tests.helpers import ToyDPO, quiet_trainer

PAIRS = [([1, 5, 6, 2], [1, 5, 7, 3, 2], 2), ([1, 4, 8], [1, 4, 9, 9], 2)]


def tinker_datum(tokens: list[int], prompt_length: int, package: Any = None) -> Any:
    """As tinker_cookbook builds them: model_input = tokens[:-1], target_tokens = tokens[1:], weights on the completion."""
    weights = [0.0] * (prompt_length - 1) + [1.0] * (len(tokens) - prompt_length)
    types = package or __import__("loops_callbacks.types", fromlist=["Datum"])
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
            "weights": types.TensorData(data=weights, dtype="float32", shape=[len(tokens) - 1]),
        },
    )


def tinker_data(package: Any = None) -> list[Any]:
    return [tinker_datum(seq, k, package) for chosen, rejected, k in PAIRS for seq in (chosen, rejected)]


def loops_data() -> list[Datum]:
    return [datum for chosen, rejected, k in PAIRS for datum in dpo_pair_datums(chosen, rejected, prompt_length=k)]


def test_a_weight_on_the_last_position_is_tinkers_convention() -> None:
    assert weighted_last_positions(tinker_data()) == [0, 1, 2, 3]
    assert weighted_last_positions(loops_data()) == []
    mixed = [{"model_input": [1, 2], "loss_fn_inputs": {"weights": torch.tensor([0.0, 0.5])}}, loops_data()[0]]
    assert weighted_last_positions(mixed) == [0]


@pytest.mark.parametrize("package", ["ours", "tinker"])
def test_tinker_datums_convert_to_the_loops_datums_of_the_same_sequences(package: str) -> None:
    module = pytest.importorskip("tinker") if package == "tinker" else None
    converted = from_tinker_convention(tinker_data(module))
    expected = loops_data()
    assert [d.model_input.to_ints() for d in converted] == [d.model_input.to_ints() for d in expected]
    for key in ("target_tokens", "weights"):
        assert [d.loss_fn_inputs[key].data for d in converted] == [d.loss_fn_inputs[key].data for d in expected]
    with pytest.raises(ValueError, match="datum 0: no weight on its last position, so it is in the Loops convention"):
        from_tinker_convention(loops_data())
    shifted_wrong = tinker_data()[0]
    shifted_wrong.loss_fn_inputs["target_tokens"] = TensorData([9, 9, 9], "int64", [3])
    with pytest.raises(ValueError, match="datum 0: target_tokens are not model_input shifted by one"):
        from_tinker_convention([shifted_wrong])


def test_the_checks_refuse_tinker_datums_naming_the_pair_and_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"pair 0: the chosen datum \(index 0\) carries weight on the last position, as in Tinker's convention"
        r".*last token's reference logprob is lost.*loops_callbacks.data.from_tinker_convention\(data\)",
    ):
        check_dpo_pairs(tinker_data())
    assert len(check_dpo_pairs(from_tinker_convention(tinker_data()))) == 4


class LastTokenMatters(torch.nn.Module):
    """Logits that make every token's logprob distinct, so a lost last-token logprob shows."""

    vocab_size = 10

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.arange(10.0).expand(*input_ids.shape, 10) * 0.3


def test_the_datamodule_refuses_them_and_scores_every_token_once_converted(tmp_path: Any) -> None:

    with pytest.raises(ValueError, match="carries weight on the last position.*from_tinker_convention"):
        quiet_trainer(max_steps=1, default_root_dir=str(tmp_path)).fit(
            ToyDPO(vocab=10), DPODataModule(tinker_data(), reference=LastTokenMatters(), use_cache=False, progress=False)
        )
    data = DPODataModule(from_tinker_convention(tinker_data()), reference=LastTokenMatters(), use_cache=False, progress=False)
    quiet_trainer(max_steps=1, default_root_dir=str(tmp_path)).fit(ToyDPO(vocab=10), data)
    logprobs = torch.log_softmax(torch.arange(10.0) * 0.3, dim=-1)
    for datum, (tokens, k) in zip(data.scored_pairs.datums(), [(s, k) for c, r, k in PAIRS for s in (c, r)]):
        inputs = datum.loss_fn_inputs
        weights = field_to_tensor(inputs["weights"], where="weights").double()
        ref = field_to_tensor(inputs["ref_logprobs"], where="ref_logprobs").double()
        completion = float(logprobs[tokens[k:]].sum())  # the last token included
        assert float((ref * weights).sum()) == pytest.approx(completion, abs=1e-5)


def test_attach_reference_logprobs_warns_once_and_scores_as_the_sdk_does() -> None:
    from loops_callbacks import attach_reference_logprobs
    from loops_callbacks.conventions import TinkerConventionWarning

    class Reference:
        def compute_logprobs(self, prompt: Any) -> list[float | None]:
            return [None] + [-1.0] * (prompt.length - 1)

    with pytest.warns(TinkerConventionWarning) as caught:
        scored = attach_reference_logprobs(tinker_data(), Reference())
    assert len(caught) == 1
    assert str(caught[0].message).startswith("4 of 4 datums (index 0, 1, 2, 3) carry weight on the last position")
    assert "from_tinker_convention(data)" in str(caught[0].message)
    assert scored[0].loss_fn_inputs["ref_logprobs"].data == [-1.0, -1.0, 0.0]  # the SDK's rule, unchanged
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", TinkerConventionWarning)
        attach_reference_logprobs(loops_data(), Reference())
