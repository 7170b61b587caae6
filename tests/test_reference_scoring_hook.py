"""When the default reference (the policy) is scored: in ``on_fit_start``, after the strategy's setup, before any dataloader."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader

from loops_callbacks.data import DPODataModule
from tests.helpers import ToyDPO
from tests.test_data import fit, make_pairs, pair_datums, ref_values, toy_model


class RecordingData(DPODataModule):
    """Notes, when the trainer asks for the training data, whether the reference was scored already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []

    def train_dataloader(self) -> DataLoader:
        self.events.append(f"train_dataloader (report: {self.reference_report is not None})")
        return super().train_dataloader()


class RecordingPolicy(ToyDPO):
    """Notes, in its own ``on_fit_start`` (after the callbacks'), what the DataModule holds."""

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        datamodule.events.append(f"on_fit_start (report: {datamodule.reference_report is not None})")


def test_the_policy_is_scored_in_on_fit_start_before_any_dataloader(tmp_path: Any) -> None:
    data = RecordingData(pair_datums(make_pairs(4)), batch_size=2, progress=False)
    fit(RecordingPolicy(), data, tmp_path, max_steps=1)
    assert data.events == ["on_fit_start (report: True)", "train_dataloader (report: True)"]
    assert data.reference_report.source == "scored"


def test_a_second_fit_scores_again_with_one_hook(tmp_path: Any) -> None:
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False, use_cache=False)
    trainer = fit(toy_model(1), data, tmp_path, max_steps=1)
    first = ref_values(data.scored_data)
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(toy_model(1), datamodule=data)
    assert ref_values(data.scored_data) == first
    hooks = [c for c in trainer.callbacks if type(c).__name__ == "_ScoreReferenceAfterStrategySetup"]
    assert len(hooks) == 1


def test_scored_data_is_kept_for_validate_after_fit(tmp_path: Any) -> None:
    class Validating(ToyDPO):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val/loss", self.training_step(batch, batch_idx))

    data = DPODataModule(pair_datums(make_pairs(6)), batch_size=2, progress=False, val_fraction=0.5)
    trainer = fit(Validating(), data, tmp_path, max_steps=1)
    scored = data.scored_data
    trainer.validate(trainer.lightning_module, datamodule=data, verbose=False)
    assert data.scored_data is scored


def test_scored_data_before_setup_names_setup() -> None:
    with pytest.raises(RuntimeError, match=r"setup\('fit'\)"):
        _ = DPODataModule(pair_datums(make_pairs(2)), progress=False).scored_data
