"""When the default reference (the policy) is scored: in ``on_fit_start``, after the strategy's setup, before data."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from loops_callbacks.data import DPODataModule, ReferenceCacheWarning
from tests.helpers import ToyDPO
from tests.data.test_data import fit, make_pairs, pair_datums, ref_values, toy_model, watched_model


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
    first = ref_values(data.scored_pairs.datums())
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(toy_model(1), datamodule=data)
    assert ref_values(data.scored_pairs.datums()) == first
    hooks = [c for c in trainer.callbacks if type(c).__name__ == "_ScoreReferenceAfterStrategySetup"]
    assert len(hooks) == 1


def test_scored_pairs_are_kept_for_validate_after_fit(tmp_path: Any) -> None:
    class Validating(ToyDPO):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val/loss", self.training_step(batch, batch_idx))

    data = DPODataModule(pair_datums(make_pairs(6)), batch_size=2, progress=False, val_fraction=0.5)
    trainer = fit(Validating(), data, tmp_path, max_steps=1)
    scored = data.scored_pairs
    trainer.validate(trainer.lightning_module, datamodule=data, verbose=False)
    assert data.scored_pairs is scored


def test_scored_pairs_before_setup_name_setup() -> None:
    with pytest.raises(RuntimeError, match=r"setup\('fit'\)"):
        _ = DPODataModule(pair_datums(make_pairs(2)), progress=False).scored_pairs


class LateRestoreStrategy(SingleDeviceStrategy):
    """Restores checkpoints after its setup, as FSDP, model parallel and DeepSpeed do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def test_a_run_resumed_under_a_strategy_that_restores_after_its_setup_uses_the_recorded_policy(tmp_path: Any) -> None:
    data = pair_datums(make_pairs(6))
    first = DPODataModule(data, batch_size=2, progress=False)
    trainer = fit(watched_model(3), first, tmp_path, max_steps=2)
    ckpt = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed_model = watched_model(4)
    resumed = DPODataModule(data, batch_size=2, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceCacheWarning)  # the checkpoint's fingerprint is known in time
        fit(resumed_model, resumed, tmp_path, max_steps=3, ckpt_path=str(ckpt),
            strategy=LateRestoreStrategy(device=torch.device("cpu")))
    assert resumed_model.scoring_calls == [] and resumed.reference_report.source == "cache"
    assert resumed.reference_report.reference_fingerprint == first.reference_report.reference_fingerprint
    assert ref_values(resumed.scored_pairs.datums()) == ref_values(first.scored_pairs.datums())


def test_a_fresh_run_under_a_strategy_that_restores_after_its_setup_scores_the_policy(tmp_path: Any) -> None:
    data = DPODataModule(pair_datums(make_pairs(4)), batch_size=2, progress=False, use_cache=False)
    model = watched_model(3)
    fit(model, data, tmp_path, max_steps=1, strategy=LateRestoreStrategy(device=torch.device("cpu")))
    assert data.reference_report.source == "scored" and model.scoring_calls
