"""The monitor's run history and the guard rail's verdict: ``summary_lines`` and the ``run_summary`` text."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from loops_callbacks import KLSampleTrainMonitor, SampleTrainDivergenceError
from loops_callbacks.demo.data import PromptDataModule
from loops_callbacks.demo.rl import RLPolicyModule
from loops_callbacks.divergence.diagnosis import CAUSES
from loops_callbacks.divergence.guard_rail import Verdict
from loops_callbacks.divergence.monitor import GuardRail, MediaOptions
from tests.helpers import RecordingLogger, TinyPolicy, TokenDataset, quiet_trainer
from tests.oracle import PREFIX


class Scripted(TinyPolicy):
    """About 100 action tokens a step; from ``probabilities_from`` on the sampler returns probabilities,
    and from ``empty_from`` on no token is masked in."""

    def __init__(self, probabilities_from: int = 10**9, empty_from: int = 10**9, nan_from: int = 10**9) -> None:
        super().__init__()
        self.probabilities_from, self.empty_from, self.nan_from = probabilities_from, empty_from, nan_from

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        if step >= self.probabilities_from:
            out["logprobs"] = out["logprobs"].exp()
        if step >= self.nan_from:
            out["logprobs"] = torch.full_like(out["logprobs"], math.nan)
        if step >= self.empty_from:
            out["mask"] = torch.zeros_like(out["logprobs"])
        return out

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(), batch_size=16)


def causes_logged(logger: RecordingLogger) -> list[tuple[int, str]]:
    """(step, cause) of each logged step, read from the ``diagnosis/<cause>`` indicators."""
    found = []
    for step, metrics in logger.calls:
        if PREFIX + "n_action_tokens" not in metrics:
            continue
        named = [cause for cause in CAUSES if metrics.get(f"{PREFIX}diagnosis/{cause}") == 1.0]
        found.append((step, named[0] if named else "no action tokens"))
    return found


def test_the_summary_counts_steps_per_cause_and_keeps_the_last_step_with_action_tokens(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recording, tensorboard = RecordingLogger(), TensorBoardLogger(str(tmp_path), name="tb")
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="warn"))
    trainer = quiet_trainer(max_steps=6, logger=[recording, tensorboard], callbacks=[monitor])
    with pytest.warns(UserWarning):
        trainer.fit(Scripted(probabilities_from=2, empty_from=5))

    per_step = causes_logged(recording)
    assert [step for step, _ in per_step] == [0, 1, 2, 3, 4, 5]
    counts: dict[str, list[int]] = {}
    for step, cause in per_step:
        counts.setdefault(cause, []).append(step)
    assert "impossible_inputs" in counts and counts["no action tokens"] == [5]
    lines = monitor.summary_lines()
    by_cause = ", ".join(f"{cause} {len(steps)} (first at step {steps[0]})" for cause, steps in counts.items())
    assert f"  steps by likely cause: {by_cause}" in lines
    assert "  last step with action tokens: 4 (the last logged step, 5, had none)" in lines
    k3 = next(line for line in lines if line.strip().startswith("kl_sample_train_k3"))
    [at_step_4] = [m for s, m in recording.calls if s == 4 and PREFIX + "kl_sample_train_k3" in m]
    assert float(k3.split()[-1]) == pytest.approx(at_step_4[PREFIX + "kl_sample_train_k3"], rel=1e-5)
    [diagnosis] = [line for line in lines if line.startswith("  last diagnosis (step 4,")]
    assert "the inputs are not valid logprobs" in diagnosis
    assert monitor.verdict is Verdict.WARNED and monitor.verdict_step == 2
    assert lines[-1].startswith("Guard rail: warned on 3 logged step(s), first at step 2 (on_exceed='warn'")

    events = EventAccumulator(tensorboard.log_dir, size_guidance={"tensors": 0}).Reload()
    [event] = events.Tensors(PREFIX + "run_summary/text_summary")
    assert event.step == trainer.global_step
    assert event.tensor_proto.string_val[0].decode() == "\n".join("    " + line for line in lines)


class Validated(Scripted):
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        pass


def test_a_stop_is_the_last_line_with_its_step_and_reason() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"), log_every_n_steps=1)
    trainer, model = quiet_trainer(max_steps=8, callbacks=[monitor], limit_val_batches=0), Validated(nan_from=2)
    with pytest.warns(UserWarning):
        trainer.fit(model)
    assert monitor.verdict is Verdict.STOPPED and monitor.verdict_step == 2
    assert monitor.summary_lines()[-1] == f"Guard rail: stopped the run at step 2: {monitor.stop_reason}"
    assert "  last step with action tokens: 1 (the last logged step, 2, had none)" in monitor.summary_lines()
    trainer.validate(model, DataLoader(TokenDataset(4), batch_size=4), verbose=False)  # a later stage
    assert monitor.verdict is Verdict.STOPPED and monitor.stop_reason is not None  # keeps the fit's verdict


def test_a_raise_is_recorded_and_the_summary_is_logged_on_the_way_out(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = TensorBoardLogger(str(tmp_path), name="tb")
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="raise"))
    with pytest.raises(SampleTrainDivergenceError) as raised:
        quiet_trainer(max_steps=8, logger=tensorboard, callbacks=[monitor]).fit(Scripted(nan_from=1))
    assert monitor.verdict is Verdict.RAISED and monitor.verdict_step == 1 and monitor.stop_reason is None
    assert monitor.summary_lines()[-1] == f"Guard rail: raised SampleTrainDivergenceError at step 1: {raised.value}"
    tensorboard.experiment.flush()
    events = EventAccumulator(tensorboard.log_dir, size_guidance={"tensors": 0}).Reload()
    [event] = events.Tensors(PREFIX + "run_summary/text_summary")
    assert "raised SampleTrainDivergenceError at step 1" in event.tensor_proto.string_val[0].decode()


@pytest.mark.parametrize(("max_kl", "verdict", "last"), [
    (None, Verdict.OFF, "Guard rail: off (max_kl not set)"),
    (0.5, Verdict.NO_EXCEEDANCE, "Guard rail: no exceedance (kl_sample_train_k3 <= 0.5 on every judged step)"),
])
def test_a_healthy_run_says_so_last(max_kl: float | None, verdict: Verdict, last: str) -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=max_kl))
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(Scripted())
    assert monitor.verdict is verdict and monitor.verdict_step is None and monitor.summary_lines()[-1] == last


class PatienceProbe(pl.Callback):
    """Records the monitor's patience counter as the resumed run starts (after the checkpoint's restore)."""

    def __init__(self, monitor: KLSampleTrainMonitor) -> None:
        super().__init__()
        self.monitor = monitor
        self.seen: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = self.monitor.guard_rail.exceeded_steps


def test_a_healthy_run_resumed_from_a_stopped_one_has_no_stop_of_its_own(tmp_path: Any) -> None:
    stopping = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    first = quiet_trainer(max_steps=8, callbacks=[stopping], default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning):
        first.fit(Scripted(nan_from=1))
    assert stopping.verdict is Verdict.STOPPED and first.global_step == 2
    checkpoint = str(tmp_path / "stopped.ckpt")
    first.save_checkpoint(checkpoint)

    resumed = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    probe = PatienceProbe(resumed)
    second = quiet_trainer(max_steps=4, callbacks=[resumed, probe], default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="KLSampleTrainMonitor")
        second.fit(Scripted(), ckpt_path=checkpoint)
    assert probe.seen == 1  # the patience counter survives the resume, as documented
    assert second.global_step == 4 and resumed.stop_reason is None
    assert resumed.verdict is Verdict.NO_EXCEEDANCE
    assert resumed.summary_lines()[-1].endswith("on every judged step since step 2)")  # the run's steps before too
    assert resumed.summary_lines()[0].endswith(": 4 logged steps")
    assert not any("Stopped" in line or "stopped" in line for line in resumed.summary_lines())


def test_a_run_shorter_than_the_logging_interval_judges_its_last_step() -> None:
    recording, monitor = RecordingLogger(), KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="warn"))
    trainer = quiet_trainer(max_steps=3, log_every_n_steps=50, logger=recording, callbacks=[monitor])
    with pytest.warns(UserWarning, match="exceeded max_kl = 0.05"):
        trainer.fit(TinyPolicy(offset=-5.0))  # the sampler 5 nats off
    assert [step for step, metrics in recording.calls if PREFIX + "kl_sample_train_k3" in metrics] == [2]
    assert monitor.verdict is Verdict.WARNED and monitor.verdict_step == 2
    assert "1 logged steps" in monitor.summary_lines()[0]


class StopsAtOnce(pl.Callback):
    """Another callback that stops the fit after its first step, before the monitor's first logged step."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.should_stop = True


@pytest.mark.parametrize(("model", "callbacks", "why"), [
    (Scripted(empty_from=0), [], "no logged step had masked-in action tokens"),
    (TinyPolicy(offset=5.0), [StopsAtOnce()],
     "no step was logged: the fit ended at optimizer step 1, before its first logged step (log_every_n_steps = 50)"),
], ids=["no action tokens", "stopped before the first logged step"])
def test_a_run_that_judged_nothing_says_so_never_no_exceedance(model: Any, callbacks: list[Any], why: str) -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05), log_every_n_steps=1 if not callbacks else 50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(max_steps=2, callbacks=[monitor, *callbacks]).fit(model)
    assert monitor.verdict is Verdict.NOTHING_JUDGED and monitor.verdict_step is None
    assert monitor.summary_lines()[-1] == f"Guard rail: nothing judged ({why})"


class StepSeeded(RLPolicyModule):
    """The demo's RL module with prompts and samples drawn from the optimizer step's seed, so that a run
    resumed from a checkpoint trains on what the uninterrupted run trained on at each step."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(self.global_step)
        prompts = self.task.sample_prompts(len(batch["prompt_ids"]), torch.Generator().manual_seed(self.global_step))
        return super().training_step({"prompt_ids": prompts}, batch_idx)


def test_a_resumed_run_names_the_causes_the_uninterrupted_run_names(tmp_path: Any) -> None:
    """What the monitor learned (the precision bound calibrated on the first healthy steps, the recent k3)
    and the run's history are in its checkpoint state: the steps after a resume are diagnosed as the same
    steps of the uninterrupted run. A bf16 sampler sampling at temperature 1.05 from step 4 on."""

    def fit(max_steps: int, ckpt_path: Any = None) -> tuple[pl.Trainer, KLSampleTrainMonitor, list[tuple[int, str]]]:
        torch.manual_seed(0)
        logger = RecordingLogger()
        monitor = KLSampleTrainMonitor(
            media=MediaOptions(log_worst_tokens=False, log_histogram=False), calibration_steps=3)
        trainer = quiet_trainer(max_steps=max_steps, logger=logger, callbacks=[monitor])
        module = StepSeeded(sampler_precision="bfloat16", sampler_temperature=1.05, faults_from_step=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, PromptDataModule(batch_size=4), ckpt_path=ckpt_path)
        return trainer, monitor, causes_logged(logger)

    _, whole, uninterrupted = fit(8)
    first, _, before = fit(4)
    checkpoint = tmp_path / "half.ckpt"
    first.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)["callbacks"][whole.state_key]  # plain data
    assert saved["calibration"]["healthy_gaps"] and saved["history"]["logged_steps"] == 4
    _, resumed, after = fit(8, ckpt_path=checkpoint)
    assert [step for step, _ in after] == [4, 5, 6, 7]
    assert before + after == uninterrupted
    assert {cause for _, cause in uninterrupted[4:]}.isdisjoint({cause for _, cause in uninterrupted[:4]})
    assert resumed.calibration == whole.calibration
    assert resumed.summary_lines() == whole.summary_lines()


def test_a_checkpoint_of_an_older_version_still_loads() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05))
    monitor.load_state_dict({"exceeded_steps": 2, "stop_reason": "an older version saved it"})
    assert monitor.guard_rail.exceeded_steps == 2 and monitor.history.logged_steps == 0 and not monitor.calibration.healthy_gaps


def test_a_resumed_fit_that_logs_nothing_says_so_and_not_that_the_run_watched_nothing(tmp_path: Any) -> None:
    first = quiet_trainer(max_steps=2, callbacks=[KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.5))])
    first.fit(Scripted())
    checkpoint = str(tmp_path / "two.ckpt")
    first.save_checkpoint(checkpoint)
    resumed = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.5), log_every_n_steps=50)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="KLSampleTrainMonitor")
        quiet_trainer(max_steps=10, callbacks=[resumed, StopsAtOnce()]).fit(Scripted(), ckpt_path=checkpoint)
    assert resumed.verdict is Verdict.NOTHING_JUDGED and resumed.summary_lines()[0].endswith(": 2 logged steps")
    assert resumed.summary_lines()[-1] == (
        "Guard rail: nothing judged (no step was logged: the fit ended at optimizer step 3, before its first "
        "logged step (log_every_n_steps = 50))"
    )
