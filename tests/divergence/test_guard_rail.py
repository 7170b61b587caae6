"""The guard rail in a real Trainer: every way a sampler breaks stops (or raises at) the right step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from loops_callbacks import KLSampleTrainMonitor, SampleTrainDivergenceError
from loops_callbacks.divergence.batch import data_keys
from loops_callbacks.divergence.monitor import GuardRail
from loops_callbacks.run_warnings import RunWarnings
from tests.helpers import RecordingLogger, TinyPolicy, TokenDataset, quiet_trainer
from tests.oracle import PREFIX

K3 = PREFIX + "kl_sample_train_k3"
Corruption = Callable[[dict[str, torch.Tensor]], None]


class BrokenSampler(TinyPolicy):
    """TinyPolicy whose returned logprobs are corrupted from optimizer step ``from_step`` on."""

    def __init__(self, corrupt: Corruption, from_step: int = 0) -> None:
        super().__init__()
        self.corrupt = corrupt
        self.from_step = from_step

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        if self.trainer.fit_loop.epoch_loop._batches_that_stepped >= self.from_step:
            out = {**out, "training_logprobs": out["training_logprobs"].detach().clone(), "logprobs": out["logprobs"].clone()}
            self.corrupt(out)
        return out


def all_nan(key: str) -> Corruption:
    def corrupt(out: dict[str, torch.Tensor]) -> None:
        out[key].fill_(math.nan)

    return corrupt


def sentinel_on_first_action_token(out: dict[str, torch.Tensor]) -> None:
    out["logprobs"][:, 5] = torch.finfo(torch.float32).min  # position 5 is masked in on every row


def probabilities(out: dict[str, torch.Tensor]) -> None:
    out["logprobs"].exp_()


def nan_share(share: float) -> Corruption:
    def corrupt(out: dict[str, torch.Tensor]) -> None:
        flat = out["logprobs"].view(-1)
        flat[: int(share * flat.numel())] = math.nan

    return corrupt


def fit(model: TinyPolicy, monitor: KLSampleTrainMonitor, **kwargs: Any) -> Any:
    trainer = quiet_trainer(max_steps=kwargs.pop("max_steps", 8), callbacks=[monitor], **kwargs)
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("key", ["training_logprobs", "logprobs"])
def test_all_nan_logprobs_stop_at_the_first_logged_step_after_the_break(key: str) -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"), log_every_n_steps=2)
    with pytest.warns(UserWarning, match="cannot be trusted"):
        trainer = fit(BrokenSampler(all_nan(key), from_step=2), monitor)
    assert trainer.global_step == 4  # logged steps are 1, 3, ...; the break came at step 2
    assert "at step 3" in monitor.stop_reason
    n = int(monitor.last_metrics[PREFIX + "n_skipped_nonfinite"])
    assert f"{n} of {n} action tokens had a non-finite logprob" in monitor.stop_reason
    assert K3 not in monitor.last_metrics  # the metric is missing: that is exactly what must not pass


def test_all_nan_logprobs_raise() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="raise"))
    trainer = quiet_trainer(max_steps=8, callbacks=[monitor])
    with pytest.raises(SampleTrainDivergenceError, match=r"(\d+) of \1 action tokens had a non-finite logprob.*at step 0"):
        trainer.fit(BrokenSampler(all_nan("logprobs")))
    assert trainer.global_step == 1  # raised as step 0 ended: no second optimizer step ran


def test_a_sentinel_sampler_logprob_stops_and_is_named() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    with pytest.warns(UserWarning) as caught:
        trainer = fit(BrokenSampler(sentinel_on_first_action_token, from_step=1), monitor)
    assert trainer.global_step == 2 and "at step 1" in monitor.stop_reason
    assert monitor.last_metrics[K3] < -1e37  # the SDK's number itself is kept as it is
    assert "kl_sample_train_k3 = -" in monitor.stop_reason
    assert "a sampler logprob of -3.4e+38 looks like a sentinel" in monitor.stop_reason
    messages = [str(w.message) for w in caught]
    sentinel = [m for m in messages if "look like sentinel values" in m and "Signaling Trainer to stop" not in m]
    assert len(sentinel) == 1 and "key 'logprobs'" in sentinel[0] and "position 5" in sentinel[0]
    assert monitor.last_diagnosis.cause == "impossible_inputs"  # the inputs, not a statistical cause


def test_a_sentinel_raises_even_when_patience_would_wait_for_more() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="raise", patience=2))
    trainer = quiet_trainer(max_steps=8, callbacks=[monitor])
    with pytest.raises(SampleTrainDivergenceError, match="looks like a sentinel.*at step 1 \\(2 logged step"):
        trainer.fit(BrokenSampler(sentinel_on_first_action_token))


def test_float64_diffs_that_overflow_make_the_metric_infinite_and_stop() -> None:
    def overflow(out: dict[str, torch.Tensor]) -> None:
        out["logprobs"] = out["logprobs"].double()
        out["logprobs"][:, 4:] = -1.7e308  # each diff finite, their sum is not

    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    with pytest.warns(UserWarning):
        trainer = fit(BrokenSampler(overflow), monitor)
    assert trainer.global_step == 1
    assert monitor.last_metrics[PREFIX + "kl_sample_train_v1_loops"] == -math.inf
    assert "kl_sample_train_k3 = -inf: a sampler logprob of -1.7e+308 looks like a sentinel" in monitor.stop_reason


def test_v1_may_be_negative_but_not_infinite() -> None:
    monitor = KLSampleTrainMonitor(
        guard_rail=GuardRail(max_kl=10.0, kl_metric="kl_sample_train_v1_loops", on_exceed="raise"))
    fit(TinyPolicy(offset=-0.05), monitor, max_steps=3)  # v1 = -mean(d) < 0 here: healthy
    assert monitor.last_metrics[PREFIX + "kl_sample_train_v1_loops"] < 0 and monitor.stop_reason is None


def test_probabilities_passed_as_logprobs_warn_once_and_stop_as_untrusted() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=10.0, on_exceed="stop", patience=3))
    with pytest.warns(UserWarning) as caught:
        trainer = fit(BrokenSampler(probabilities), monitor)
    assert trainer.global_step == 3 and "at step 2" in monitor.stop_reason  # whatever the bound: not logprobs
    assert "the step cannot be trusted: " in monitor.stop_reason and "look like probabilities" in monitor.stop_reason
    hints = [str(w.message) for w in caught if "look like probabilities" in str(w.message)]
    hints = [m for m in hints if "Signaling Trainer to stop" not in m]  # the stop's own message names them too
    assert len(hints) == 1 and "key 'logprobs'" in hints[0] and "step 0" in hints[0]


class WiderBatches(BrokenSampler):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(), batch_size=16)  # about 100 action tokens a step: enough to diagnose


def all_zero_trainer(out: dict[str, torch.Tensor]) -> None:
    out["training_logprobs"].zero_()


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [
        (probabilities, "these look like probabilities, not logprobs"),
        (sentinel_on_first_action_token, "these look like sentinel values, not logprobs"),
        (all_zero_trainer, "trainer logprobs is exactly 0.0"),
    ],
)
def test_impossible_inputs_are_the_cause_the_stop_names_not_a_statistical_one(corrupt: Corruption, named: str) -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    with pytest.warns(UserWarning):
        fit(WiderBatches(corrupt), monitor)
    assert monitor.last_metrics[PREFIX + "n_action_tokens"] >= 64  # the statistical rule would have judged it
    assert monitor.last_diagnosis is not None and monitor.last_diagnosis.cause == "impossible_inputs"
    assert "likely cause: the inputs are not valid logprobs: " in monitor.stop_reason and named in monitor.stop_reason
    for statistical in ("truncat", "temperature", "stale", "shifted", "unrelated", "precision", "a hint"):
        assert statistical not in monitor.stop_reason


def test_without_the_diagnosis_the_stop_still_names_impossible_inputs() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"), diagnose=False)
    with pytest.warns(UserWarning):
        fit(WiderBatches(probabilities), monitor)
    assert monitor.last_diagnosis is None
    assert "likely cause: the inputs are not valid logprobs: " in monitor.stop_reason
    assert "check that the sampler receives the trainer's weights" not in monitor.stop_reason


def test_a_share_of_nonfinite_tokens_above_the_bound_exceeds() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    with pytest.warns(UserWarning, match="more than max_nonfinite_fraction = 0.01"):
        trainer = fit(BrokenSampler(nan_share(0.25), from_step=2), monitor)
    assert trainer.global_step == 3 and "at step 2" in monitor.stop_reason
    assert 0 < monitor.last_metrics[PREFIX + "n_skipped_nonfinite"] < monitor.last_metrics[PREFIX + "n_action_tokens"]
    # what it stopped on is that it cannot judge the step, not a likely cause read off the rest ("usually harmless")
    assert "counts as exceeding the bound; fix what makes the logprobs unreadable" in monitor.stop_reason
    assert "likely cause:" not in monitor.stop_reason and "no longer match" not in monitor.stop_reason


def test_a_share_below_the_bound_is_counted_but_trusted() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="raise", max_nonfinite_fraction=0.5))
    trainer = fit(BrokenSampler(nan_share(0.1)), monitor, max_steps=3)
    assert trainer.global_step == 3 and monitor.stop_reason is None
    assert monitor.last_metrics[PREFIX + "n_skipped_nonfinite"] > 0


def test_nothing_skipped_is_the_healthy_case() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.5, on_exceed="raise", max_nonfinite_fraction=0.0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="KLSampleTrainMonitor")
        trainer = fit(TinyPolicy(), monitor, max_steps=4)
    assert trainer.global_step == 4 and monitor.last_metrics[PREFIX + "n_skipped_nonfinite"] == 0


def test_a_typo_in_kl_metric_fails_at_construction_listing_the_names() -> None:
    with pytest.raises(ValueError, match=r"kl_metric='kl_k3' is not a metric the monitor logs.*'kl_sample_train_k3'"):
        KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, kl_metric="kl_k3"))
    with pytest.raises(ValueError, match=r"with the prefix 'div/'"):
        KLSampleTrainMonitor(
            guard_rail=GuardRail(max_kl=0.05, kl_metric="optim/train-sample-div/kl_sample_train_k3"), prefix="div/")
    assert KLSampleTrainMonitor(
        guard_rail=GuardRail(kl_metric="div/diff_abs_p99"), prefix="div/").guard_rail.kl_metric == "diff_abs_p99"


def test_steps_without_action_tokens_are_not_exceedances_but_say_the_monitor_watches_nothing() -> None:
    def no_mask(out: dict[str, torch.Tensor]) -> None:
        out["mask"] = torch.zeros_like(out["logprobs"])  # the returned dict is read before the batch

    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="raise"))
    with pytest.warns(UserWarning, match="watching nothing") as caught:
        trainer = fit(BrokenSampler(no_mask), monitor, max_steps=6)
    assert trainer.global_step == 6 and monitor.stop_reason is None
    assert sum("watching nothing" in str(w.message) for w in caught) == 1


def test_without_a_bound_an_untrusted_step_is_still_reported() -> None:
    monitor = KLSampleTrainMonitor()
    with pytest.warns(UserWarning, match=r"(\d+) of \1 action tokens had a non-finite logprob"):
        trainer = fit(BrokenSampler(all_nan("logprobs")), monitor, max_steps=3)
    assert trainer.global_step == 3 and monitor.stop_reason is None


def test_the_stop_is_visible_in_tensorboard_at_its_step(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    with pytest.warns(UserWarning):
        fit(BrokenSampler(all_nan("logprobs"), from_step=1), monitor, logger=logger)
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0}).Reload()
    [tag] = [t for t in events.Tags()["tensors"] if t.startswith(PREFIX + "guard_rail")]
    [event] = events.Tensors(tag)
    assert event.step == 1 and b"cannot be trusted" in event.tensor_proto.string_val[0]


def test_the_patience_counter_resets_after_a_trusted_step_below_the_bound() -> None:
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop", patience=2))
    fit(BrokenSampler(sentinel_on_first_action_token, from_step=5), monitor, max_steps=5, logger=RecordingLogger())
    assert monitor.guard_rail.exceeded_steps == 0 and monitor.stop_reason is None


def test_a_kl_metric_no_monitor_logs_is_refused_by_the_guard_rail_itself() -> None:
    """Not first when a monitor is built with it: a GuardRail made alone (a config's group) says so at once."""
    with pytest.raises(ValueError, match=r"kl_metric='kl' is not a metric the monitor logs; .* monitor's prefix\)"):
        GuardRail(kl_metric="kl")
    assert GuardRail(kl_metric="my/prefix/kl_sample_train_k3").kl_metric == "my/prefix/kl_sample_train_k3"


def test_one_guard_rail_given_to_two_monitors_counts_and_judges_for_each_alone() -> None:
    """The guard rail owns its counter and verdict (as EarlyStopping does); each monitor holds its own copy, so
    the user's object, or the one default, is never shared or changed."""
    shared = GuardRail(max_kl=0.05, on_exceed="warn", patience=3)
    broken, healthy = KLSampleTrainMonitor(guard_rail=shared), KLSampleTrainMonitor(guard_rail=shared)
    assert broken.guard_rail is not shared and broken.guard_rail is not healthy.guard_rail
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(BrokenSampler(sentinel_on_first_action_token, from_step=0), broken, max_steps=2, log_every_n_steps=1)
    fit(TinyPolicy(), healthy, max_steps=2, log_every_n_steps=1)
    assert broken.guard_rail.exceeded_steps == 2 and broken.guard_rail.judged_steps == 2
    assert healthy.guard_rail.exceeded_steps == 0 and healthy.verdict.value == "no exceedance"
    assert (shared.exceeded_steps, shared.judged_steps, shared.action) == (0, 0, None)
    assert broken.state_dict()["exceeded_steps"] == 2 and broken.guard_rail.state_dict() == {"exceeded_steps": 2}


def test_the_guard_rail_acts_after_its_patience_and_keeps_its_first_warning() -> None:
    class Report:  # what on_step reads of a StepReport
        scalars = {"n_action_tokens": 8.0}
        exceeds, untrusted, problems, diagnosis = "kl_sample_train_k3 = 0.2 exceeded max_kl = 0.05", None, {}, None

    class Trainer:
        should_stop = False

    said: list[str] = []
    rail = GuardRail(max_kl=0.05, on_exceed="warn", patience=2)
    with pytest.warns(UserWarning, match="at step 1 \\(2 logged step\\(s\\) in a row, patience 2\\)"):
        for step in range(3):
            rail.on_step(Trainer(), Report(), step, say=said.append, warnings=RunWarnings(), keys=data_keys(None))
    assert len(said) == 2 and rail.verdict_step == 1 and rail.times_acted == 2 and rail.verdict.value == "warned"
    assert rail.verdict_line(steps_trained=3, log_every_n_steps=1).startswith(
        "Guard rail: warned on 2 logged step(s), first at step 1")


@pytest.mark.parametrize(("logged", "ended"), [(3, False), (2, True), (2, False)])
def test_the_guard_rail_says_once_that_a_fit_without_action_tokens_watches_nothing(logged: int, ended: bool) -> None:
    """After WATCHING_NOTHING_AFTER logged steps without action tokens, or when a shorter fit ends."""
    class Report:  # a logged step without masked-in action tokens
        scalars = {"n_action_tokens": 0.0, "n_skipped_nonfinite": 0.0}
        exceeds, untrusted, problems, diagnosis = None, None, {}, None

    rail, said = GuardRail(max_kl=0.05), RunWarnings()
    keys = data_keys({"mask": "my_mask"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(logged):
            rail.on_step(None, Report(), step, say=print, warnings=said, keys=keys)
        if ended:
            rail.on_train_end(said, keys)
    told = [str(w.message) for w in caught if "watching nothing" in str(w.message)]
    assert len(told) == int(logged == 3 or ended) and rail.verdict.value == "nothing judged"
    assert all(f"none of the {logged} logged step(s) had an action token ('my_mask' > 0" in t for t in told)
