"""KLSampleTrainMonitor under a real Trainer: windows, loggers, guard rail, contract errors."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from torch.utils.data import DataLoader

from loops_callbacks import KLSampleTrainMonitor, SampleTrainDivergenceError
from loops_callbacks.types import ForwardBackwardOutput
from loops_callbacks.divergence.monitor import GuardRail, MediaOptions
from tests.helpers import (
    RecordingLogger,
    TinyPolicy,
    TokenDataset,
    assert_metrics_equal,
    datums_of,
    expected_metrics,
    quiet_trainer,
    scalars,
)
from tests.oracle import PREFIX

K3 = PREFIX + "kl_sample_train_k3"


@pytest.mark.parametrize("accumulate", [2, 4])
def test_one_log_per_optimizer_step_equal_to_the_function_on_the_window(accumulate: int) -> None:
    model, logger = TinyPolicy(), RecordingLogger()
    trainer = quiet_trainer(
        max_steps=3, accumulate_grad_batches=accumulate, logger=logger,
        callbacks=[KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False))],
    )
    trainer.fit(model)
    ours = [(step, m) for step, m in logger.calls if K3 in m]
    assert [step for step, _ in ours] == [0, 1, 2]
    for step, metrics in ours:
        window = [r for r in model.recorded if r["step"] == step]
        assert len(window) == accumulate
        assert_metrics_equal(scalars(metrics), expected_metrics(window))


def test_forward_backward_interval_logs_every_micro_batch() -> None:
    model, logger = TinyPolicy(), RecordingLogger()
    trainer = quiet_trainer(
        max_steps=2, accumulate_grad_batches=2, logger=logger,
        callbacks=[KLSampleTrainMonitor(interval="forward_backward")],
    )
    trainer.fit(model)
    ours = [m for _, m in logger.calls if K3 in m]
    assert len(ours) == 4
    for metrics, record in zip(ours, model.recorded):
        assert_metrics_equal(scalars(metrics), expected_metrics([record]))


def test_respects_log_every_n_steps_and_costs_nothing_between(monkeypatch: Any) -> None:
    from loops_callbacks.divergence import monitor as monitor_module
    from loops_callbacks.divergence.statistics import DivergenceStats

    computed = []

    def counting_from_batch(flat: Any, *args: Any, **kwargs: Any) -> DivergenceStats:
        computed.append(flat)
        return DivergenceStats.from_batch(flat, *args, **kwargs)

    counting = type("CountingStats", (), {"from_batch": staticmethod(counting_from_batch)})
    monkeypatch.setattr(monitor_module, "DivergenceStats", counting)
    model, logger = TinyPolicy(), RecordingLogger()
    monitor = KLSampleTrainMonitor(log_every_n_steps=3)
    trainer = quiet_trainer(max_steps=7, logger=logger, callbacks=[monitor])
    trainer.fit(model)
    assert [step for step, m in logger.calls if K3 in m] == [2, 5]
    assert len(computed) == 2  # statistics ran on the two logged steps only


def test_offline_wandb_run_gets_scalars_histogram_and_table(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="loops-callbacks-tests")
    model = TinyPolicy()
    trainer = quiet_trainer(max_steps=4, logger=logger, callbacks=[KLSampleTrainMonitor(log_every_n_steps=2)])
    trainer.fit(model)
    run_dir = logger.experiment.dir
    logger.experiment.finish()
    every_table = glob.glob(os.path.join(run_dir, "media", "table", "**", "*.table.json"), recursive=True)
    tables = [path for path in every_table if os.path.basename(path).startswith("worst_tokens")]
    assert len(tables) == 2  # steps 1 and 3
    strata = [path for path in every_table if os.path.basename(path).startswith("strata")]
    assert len(strata) == 2 and len(every_table) == 4  # and the strata view, once per logged step
    with open(sorted(tables)[-1]) as handle:
        table = json.load(handle)
    assert table["columns"][:4] == ["rank", "datum", "position", "token"] and len(table["data"]) == 20
    window = datums_of([r for r in model.recorded if r["step"] == 3])
    from loops_callbacks import loops_log_kl_sample_train

    want = loops_log_kl_sample_train(None, 3, window[0], training_logprobs=window[1])
    assert table["data"] == want[PREFIX + "worst_tokens"].data
    [summary] = glob.glob(os.path.join(run_dir, "media", "html", "**", "run_summary_*.html"), recursive=True)
    with open(summary) as handle:
        assert "Guard rail: off (max_kl not set)</pre>" in handle.read()  # the verdict last, as HTML text
    with open(os.path.join(run_dir, "..", "logs", "debug-internal.log")) as log:
        assert "monotonically increasing" not in log.read()  # W&B dropped nothing


def test_tensorboard_and_csv_loggers_receive_the_scalars(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = TensorBoardLogger(str(tmp_path), name="tb")
    csv = CSVLogger(str(tmp_path), name="csv")
    trainer = quiet_trainer(max_steps=2, logger=[tensorboard, csv], callbacks=[KLSampleTrainMonitor()])
    trainer.fit(TinyPolicy())
    events = EventAccumulator(tensorboard.log_dir, size_guidance={"histograms": 0, "tensors": 0}).Reload()
    assert K3 in events.Tags()["scalars"]
    assert PREFIX + "per_token_diff_hist" in events.Tags()["histograms"]
    assert any(PREFIX + "worst_tokens" in tag for tag in events.Tags()["tensors"])
    with open(os.path.join(csv.log_dir, "metrics.csv")) as handle:
        assert K3 in handle.readline()


def test_a_step_s_media_are_built_once_whatever_the_number_of_loggers(tmp_path: Any) -> None:
    """The worst-tokens rows (and the histogram's values) are part of the step's report, not of each logger."""

    class CountingTokenizer:
        calls = 0

        def decode(self, ids: list[int]) -> str:
            CountingTokenizer.calls += 1
            return f"<{ids[0]}>" if ids else ""

    def decodes(loggers: int) -> int:
        CountingTokenizer.calls = 0
        tensorboards = [TensorBoardLogger(str(tmp_path), name=f"tb{loggers}_{i}") for i in range(loggers)]
        monitor = KLSampleTrainMonitor(tokenizer=CountingTokenizer(), log_every_n_steps=1)
        quiet_trainer(max_steps=1, logger=tensorboards, callbacks=[monitor]).fit(TinyPolicy())
        return CountingTokenizer.calls

    one = decodes(1)
    assert one > 0 and decodes(3) == one


def test_a_failing_logger_is_a_warning_and_training_goes_on() -> None:
    class Broken(RecordingLogger):
        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            if K3 in metrics:
                raise OSError("No space left on device")

    trainer = quiet_trainer(max_steps=3, logger=Broken(), callbacks=[KLSampleTrainMonitor()])
    with pytest.warns(UserWarning, match="could not log to Broken.*training goes on") as caught:
        trainer.fit(TinyPolicy())
    assert trainer.global_step == 3
    assert sum("could not log to Broken" in str(w.message) for w in caught) == 1  # once per run, not every step


def test_early_stopping_and_checkpointing_can_monitor_the_metric(tmp_path: Any) -> None:
    stopper = EarlyStopping(monitor=K3, mode="min", patience=100, strict=True, check_on_train_epoch_end=True)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor=K3, mode="min", save_top_k=1)
    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=4, enable_checkpointing=True,
        callbacks=[KLSampleTrainMonitor(), stopper, checkpoint],
    )
    trainer.fit(TinyPolicy())  # strict=True would raise if the key were missing
    assert K3 in trainer.callback_metrics
    assert checkpoint.best_model_score is not None


def test_stop_ends_training_with_a_message_naming_step_value_and_bound() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, patience=2, on_exceed="stop"))
    trainer = quiet_trainer(max_steps=50, callbacks=[monitor])
    with pytest.warns(UserWarning, match="exceeded max_kl"):
        trainer.fit(TinyPolicy(offset=1.0))  # a stale sampler: every token off by 1 nat
    assert trainer.global_step == 2
    assert "at step 1" in monitor.stop_reason and "max_kl = 0.05" in monitor.stop_reason
    assert K3 in monitor.stop_reason


def test_raise_raises() -> None:
    trainer = quiet_trainer(max_steps=5, callbacks=[KLSampleTrainMonitor(
        guard_rail=GuardRail(max_kl=0.05, on_exceed="raise"))])
    with pytest.raises(SampleTrainDivergenceError, match="exceeded max_kl"):
        trainer.fit(TinyPolicy(offset=1.0))


def test_healthy_run_is_not_stopped() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.5, on_exceed="stop"))
    trainer = quiet_trainer(max_steps=4, callbacks=[monitor])
    trainer.fit(TinyPolicy())
    assert trainer.global_step == 4 and monitor.stop_reason is None


def test_resume_keeps_the_patience_counter(tmp_path: Any) -> None:
    first = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, patience=3, on_exceed="stop"))
    trainer = quiet_trainer(max_steps=2, callbacks=[first], default_root_dir=str(tmp_path))
    trainer.fit(TinyPolicy(offset=1.0))
    assert first.guard_rail.exceeded_steps == 2
    path = str(tmp_path / "two.ckpt")
    trainer.save_checkpoint(path)

    resumed = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, patience=3, on_exceed="stop"))
    trainer = quiet_trainer(max_steps=50, callbacks=[resumed], default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="exceeded max_kl"):
        trainer.fit(TinyPolicy(offset=1.0), ckpt_path=path)
    assert trainer.global_step == 3  # one more step was enough: the count came back from the checkpoint


def test_missing_training_logprobs_fails_on_the_first_step_with_a_fix() -> None:
    class NoLogprobs(TinyPolicy):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            return {"loss": out["loss"], "logprobs": out["logprobs"]}

    trainer = quiet_trainer(max_steps=5, callbacks=[KLSampleTrainMonitor(log_every_n_steps=50)])
    with pytest.raises(ValueError, match=r"no 'training_logprobs'.*'loss': loss, 'training_logprobs'"):
        trainer.fit(NoLogprobs())
    assert trainer.global_step <= 1


def test_missing_sampler_logprobs_names_the_keys() -> None:
    class NoSampler(TinyPolicy):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            return {"loss": out["loss"], "training_logprobs": out["training_logprobs"]}

    trainer = quiet_trainer(max_steps=2, callbacks=[KLSampleTrainMonitor()])
    with pytest.raises(ValueError, match=r"has \['logprobs'\]"):
        trainer.fit(NoSampler())


def test_shape_mismatch_between_batch_and_output_is_named() -> None:
    class Truncated(TinyPolicy):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            return {**out, "training_logprobs": out["training_logprobs"][:, :-1]}

    trainer = quiet_trainer(max_steps=2, callbacks=[KLSampleTrainMonitor()])
    with pytest.raises(ValueError, match=r"'logprobs' has shape \(4, 12\) but 'training_logprobs' has \(4, 11\)"):
        trainer.fit(Truncated())


def test_integer_sampler_logprobs_are_a_type_error_naming_the_key() -> None:
    """A zeros_like of the token ids is no logprob: read as numbers it was diagnosed 'truncation', confidence 1."""
    class IntegerLogprobs(TinyPolicy):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            return {**out, "logprobs": torch.zeros_like(out["training_logprobs"], dtype=torch.long)}

    trainer = quiet_trainer(max_steps=2, callbacks=[KLSampleTrainMonitor()])
    with pytest.raises(TypeError, match=r"'logprobs' must hold floating-point logprobs .* got dtype torch.int64"):
        trainer.fit(IntegerLogprobs())


def test_manual_optimization_and_bf16_mixed() -> None:
    model, logger = TinyPolicy(manual=True), RecordingLogger()
    trainer = quiet_trainer(max_steps=3, precision="bf16-mixed", logger=logger, callbacks=[KLSampleTrainMonitor()])
    trainer.fit(model)
    ours = [(step, m) for step, m in logger.calls if K3 in m]
    assert [step for step, _ in ours] == [0, 1, 2]
    for step, metrics in ours:
        assert_metrics_equal(scalars(metrics), expected_metrics([r for r in model.recorded if r["step"] == step]))


def test_loops_form_batches_of_datums() -> None:
    class LoopsPolicy(TinyPolicy):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids = torch.stack([torch.tensor(d.model_input.to_ints()) for d in batch])
            targets = torch.stack([d.loss_fn_inputs["target_tokens"] for d in batch])
            logprobs = torch.log_softmax(self(ids), -1).gather(-1, targets[..., None]).squeeze(-1)
            loss = -logprobs.mean()
            output = ForwardBackwardOutput(loss_fn_output_type="x", loss_fn_outputs=[{"logprobs": row} for row in logprobs])
            self.recorded.append({"trainer": logprobs.detach(), "batch": batch})
            return {"loss": loss, "forward_backward_output": output}

        def train_dataloader(self) -> DataLoader:
            records = [{k: v[None] for k, v in TokenDataset()[i].items()} for i in range(16)]
            for r in records:
                r.update(sampler=r["noise"].double() - 2.0, trainer=torch.zeros(1, 12, dtype=torch.float64))
            datums, _ = datums_of(records)
            return DataLoader(datums, batch_size=4, collate_fn=list)

    model, logger = LoopsPolicy(), RecordingLogger()
    trainer = quiet_trainer(max_steps=2, logger=logger, callbacks=[KLSampleTrainMonitor()])
    trainer.fit(model)
    from loops_callbacks import loops_compute_kl_sample_train

    ours = [m for _, m in logger.calls if K3 in m]
    assert len(ours) == 2
    for metrics, record in zip(ours, model.recorded):
        want = loops_compute_kl_sample_train(record["batch"], list(record["trainer"]))
        assert_metrics_equal(scalars(metrics), want)


def test_invalid_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="interval must be"):
        KLSampleTrainMonitor(interval="epoch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_n must be an int >= 0, got -1"):
        KLSampleTrainMonitor(media=MediaOptions(top_n=-1))
    with pytest.raises(ValueError, match="on_exceed"):
        KLSampleTrainMonitor(guard_rail=GuardRail(on_exceed="panic"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decode"):
        KLSampleTrainMonitor(tokenizer=object())


def test_keys_remap_where_the_data_is_read_and_reject_unknown_names() -> None:
    class Renamed(TinyPolicy):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            return {"loss": out["loss"], "trainer_lp": out["training_logprobs"], "sampler_lp": out["logprobs"]}

    model, logger = Renamed(), RecordingLogger()
    monitor = KLSampleTrainMonitor(keys={"training_logprobs": "trainer_lp", "logprobs": "sampler_lp"})
    quiet_trainer(max_steps=2, logger=logger, callbacks=[monitor]).fit(model)
    ours = [m for _, m in logger.calls if K3 in m]
    assert len(ours) == 2
    assert_metrics_equal(scalars(ours[-1]), expected_metrics([model.recorded[-1]]))
    with pytest.raises(ValueError, match=r"keys has unknown names \['sampler_logprobs'\]; the names are \['data'"):
        KLSampleTrainMonitor(keys={"sampler_logprobs": "lp"})


def test_a_renamed_lightning_loop_attribute_fails_at_setup_naming_the_version(monkeypatch: Any) -> None:
    import lightning
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    monkeypatch.delattr(_TrainingEpochLoop, "_should_accumulate")
    trainer = quiet_trainer(max_steps=2, callbacks=[KLSampleTrainMonitor()])
    with pytest.raises(RuntimeError, match=rf"_should_accumulate\(\).*Lightning {lightning.__version__} does not have"):
        trainer.fit(TinyPolicy())
