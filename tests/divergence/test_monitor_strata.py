"""The monitor logs the divergence by stratum and the shadow metrics of its corrections for every
optimizer step's window (all its micro-batches, every rank), with lags from the datums' policy
versions, as the statistics of the whole window give them."""

from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence import batch as per_datum, report
from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.statistics import parse_corrections, shadow_scalars, shadow_values
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from loops_callbacks.divergence.statistics import stratum_scalars
from loops_callbacks.divergence.monitor import MediaOptions
from tests.helpers import RecordingLogger, TinyPolicy, quiet_trainer
from tests.oracle import PREFIX

MAX_GROUPS = 2
CORRECTIONS = ["sequence_mask:1.05", "token_truncate:1.1", "geo:0.98_1.02", "off_policy_mask:0.001"]


class VersionedPolicy(TinyPolicy):
    """Returns each row's policy version (1 to 3 steps behind, or current) and group id, and records them."""

    def __init__(self, out_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        rows = batch["input_ids"].shape[0]
        behind = (torch.arange(rows) + batch_idx + 3 * self.global_rank) % 4
        versions = (step - behind).clamp(min=0)
        groups = (torch.arange(rows) + batch_idx) % (MAX_GROUPS + 2)  # some beyond max_groups: pooled
        self.recorded[-1].update(versions=versions, groups=groups)
        return {**out, "policy_version": versions, "group": groups.tolist()}

    def on_train_end(self) -> None:
        if self.out_dir is not None:
            torch.save(self.recorded, os.path.join(self.out_dir, f"rank{self.global_rank}.pt"))


def window_flat(window: list[dict[str, Any]], step: int) -> Any:
    cat = {key: torch.cat([record[key] for record in window]) for key in window[0] if key != "step"}
    flat = flatten_padded(
        sampler_logprobs=cat["sampler"], training_logprobs=cat["trainer"], mask=cat["mask"],
        advantages=cat["advantages"],
    )
    return dataclasses.replace(flat, lags=step - cat["versions"], groups=cat["groups"])


def expected_strata(window: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The strata scalars of the window's micro-batches concatenated, computed in one piece."""
    host = DivergenceStats.from_batch(window_flat(window, step), StatisticsOptions(max_groups=MAX_GROUPS)).to_host()
    return {PREFIX + name: value for name, value in stratum_scalars(host.strata).items()}


def expected_shadow(window: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The corrections' shadow scalars of the window's micro-batches concatenated, in one piece."""
    advantages = torch.cat([record["advantages"] for record in window]).double()  # one per datum
    corrections = parse_corrections(CORRECTIONS)
    values = shadow_values(window_flat(window, step), corrections, advantages)
    return {PREFIX + name: value for name, value in shadow_scalars(values, values, corrections).items()}


def assert_close(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key.endswith("/n_tokens") or "/frac_" in key or "/raw/" in key:  # counts and extrema: exact
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_strata_of_each_accumulation_window_and_one_pooled_groups_warning() -> None:
    model, logger = VersionedPolicy(), RecordingLogger()
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False, max_groups=MAX_GROUPS))
    trainer = quiet_trainer(max_steps=3, accumulate_grad_batches=2, logger=logger, callbacks=[monitor])
    pooled = r"'group' >= max_groups = 2 \(or negative\) are pooled in the stratum 'group_other'"
    with pytest.warns(UserWarning, match=pooled) as seen:
        trainer.fit(model)
    assert sum("group_other" in str(w.message) for w in seen) == 1
    assert not any("was usable for" in str(w.message) for w in seen)  # every datum gave both keys
    logged = [(step, m) for step, m in logger.calls if PREFIX + "stratum/pos_q1/k3" in m]
    assert [step for step, _ in logged] == [0, 1, 2]
    for step, metrics in logged:
        window = [r for r in model.recorded if r["step"] == step]
        assert len(window) == 2
        want = expected_strata(window, step)
        assert PREFIX + "stratum/lag_1/k3" in want or step == 0
        assert_close({key: value for key, value in metrics.items() if "/stratum/" in key}, want)
    assert [step for step, m in logger.calls if PREFIX + "kl_sample_train_k3" in m] == [0, 1, 2]  # one record a step


class MislabelledPolicy(TinyPolicy):
    """Returns what users do return: a negative group id, string labels, versions ahead of the trainer."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        out = super().training_step(batch, batch_idx)
        rows = batch["input_ids"].shape[0]
        groups: list[Any] = [-1] + [0] * (rows - 1) if batch_idx % 2 else ["math", "code"] * (rows // 2)
        return {**out, "group": groups, "policy_version": [self.global_step + 1] * rows}


def test_per_datum_keys_the_strata_cannot_use_never_stop_training() -> None:
    logger = RecordingLogger()
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False, max_groups=MAX_GROUPS))
    trainer = quiet_trainer(max_steps=4, logger=logger, callbacks=[monitor])
    with pytest.warns(UserWarning) as seen:
        trainer.fit(MislabelledPolicy())
    messages = [str(w.message) for w in seen]
    for said in ("'group' = -1 (< 0)", "'group' holds labels", "ahead of the trainer's optimizer step"):
        assert sum(said in message for message in messages) == 1, said  # once per run
    assert trainer.global_step == 4
    logged = [m for _, m in logger.calls if PREFIX + "stratum/lag_0/n_tokens" in m]
    assert len(logged) == 4 and all(PREFIX + "stratum/lag_1/n_tokens" not in m for m in logged)


def test_on_an_accelerator_the_keys_are_used_unread_and_what_they_hide_is_said_after_the_host_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Int tensors on an accelerator are not read on the host per micro-batch: a version ahead and a
    negative group are counted by the strata and said from the step's one host read."""

    class OnDevice(TinyPolicy):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
            rows = batch["input_ids"].shape[0]
            versions = torch.full((rows,), self.global_step + 1)  # ahead of the trainer
            groups = torch.tensor([-1] + [0] * (rows - 1))
            return {**super().training_step(batch, batch_idx), "policy_version": versions, "group": groups}

    monkeypatch.setattr(per_datum, "_on_accelerator", lambda values: True)
    logger = RecordingLogger()
    trainer = quiet_trainer(max_steps=2, logger=logger, callbacks=[KLSampleTrainMonitor(
        media=MediaOptions(log_worst_tokens=False))])
    with pytest.warns(UserWarning) as seen:
        trainer.fit(OnDevice())
    messages = [str(w.message) for w in seen]
    assert sum("ahead of the trainer's optimizer step; they are counted at lag 0" in m for m in messages) == 1
    assert sum("(or negative) are pooled in the stratum 'group_other'" in m for m in messages) == 1
    assert not any("datum 0 has" in m for m in messages)  # nothing was read per datum
    last = [m for _, m in logger.calls if PREFIX + "stratum/pos_q1/k3" in m][-1]
    assert last[PREFIX + "stratum/lag_ahead/n_tokens"] == last[PREFIX + "stratum/lag_0/n_tokens"] > 0


def test_a_policy_version_on_the_meta_device_never_stops_training() -> None:
    class OnMeta(TinyPolicy):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
            versions = torch.zeros(batch["input_ids"].shape[0], dtype=torch.int64, device="meta")
            return {**super().training_step(batch, batch_idx), "policy_version": versions}

    logger = RecordingLogger()
    trainer = quiet_trainer(max_steps=2, logger=logger, callbacks=[KLSampleTrainMonitor(
        media=MediaOptions(log_worst_tokens=False))])
    with pytest.warns(UserWarning, match="'policy_version' cannot be read from the meta device") as seen:
        trainer.fit(OnMeta())
    assert trainer.global_step == 2 and sum("meta device" in str(w.message) for w in seen) == 1
    logged = [m for _, m in logger.calls if PREFIX + "stratum/pos_q1/k3" in m]
    assert len(logged) == 2 and not any("/stratum/lag_" in key for m in logged for key in m)


def test_strata_off_logs_nothing_more() -> None:
    logger = RecordingLogger()
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False, log_strata=False))
    quiet_trainer(max_steps=2, logger=logger, callbacks=[monitor]).fit(VersionedPolicy())
    assert logger.calls and not any("/stratum/" in key for _, metrics in logger.calls for key in metrics)


def test_shadow_metrics_of_each_accumulation_window_and_nothing_else_changes() -> None:
    runs = {}
    for corrections in ([], CORRECTIONS):
        torch.manual_seed(0)  # the same policy in both runs
        model, logger = VersionedPolicy(), RecordingLogger()
        monitor = KLSampleTrainMonitor(
            media=MediaOptions(log_worst_tokens=False, log_histogram=False), corrections=corrections)
        quiet_trainer(max_steps=3, accumulate_grad_batches=2, logger=logger, callbacks=[monitor]).fit(model)
        runs[len(corrections)] = model, logger.calls
    model, calls = runs[len(CORRECTIONS)]
    shadowed = [(step, m) for step, m in calls if PREFIX + "correction/geo(lower=0.98, upper=1.02)/ess_tokens" in m]
    assert [step for step, _ in shadowed] == [0, 1, 2]
    for step, metrics in shadowed:
        want = expected_shadow([r for r in model.recorded if r["step"] == step], step)
        assert want[PREFIX + "correction/sequence_mask(clip_max=1.05)/frac_seqs_masked"] > 0
        assert 0 < want[PREFIX + "correction/off_policy_mask(threshold=0.001)/frac_seqs_masked"] < 1
        assert_close({key: value for key, value in metrics.items() if "/correction/" in key}, want)
    without = [(step, {k: v for k, v in m.items() if "/correction/" not in k}) for step, m in calls]
    assert without == runs[0][1]  # everything else logged is the same, bit for bit


def test_strata_and_shadow_scalars_are_in_callback_metrics_for_early_stopping() -> None:
    """What the loggers get beside the metrics is also in ``trainer.callback_metrics`` (every rank)."""
    logger = RecordingLogger()
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False), corrections=CORRECTIONS[:2])
    trainer = quiet_trainer(max_steps=2, logger=logger, callbacks=[monitor])
    trainer.fit(VersionedPolicy())
    last = [m for _, m in logger.calls if PREFIX + "stratum/pos_q1/k3" in m][-1]
    assert PREFIX + "correction/token_truncate(clip_max=1.1)/ess_tokens" in last
    scalars = {key: value for key, value in last.items() if isinstance(value, float)}
    assert len(scalars) > 20
    for key, value in scalars.items():
        assert float(trainer.callback_metrics[key]) == pytest.approx(value, rel=1e-6, nan_ok=True), key


def test_a_stratum_not_logged_at_a_step_leaves_callback_metrics() -> None:
    """EarlyStopping must not read the number of an earlier step: each step's groups are its own."""

    class OneGroupPerStep(TinyPolicy):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
            return {**super().training_step(batch, batch_idx), "group": [self.global_step % 2] * len(batch["mask"])}

    logger = RecordingLogger()
    trainer = quiet_trainer(max_steps=2, logger=logger, callbacks=[KLSampleTrainMonitor(
        media=MediaOptions(log_worst_tokens=False))])
    trainer.fit(OneGroupPerStep())
    first, last = [m for _, m in logger.calls if PREFIX + "stratum/pos_q1/k3" in m]
    assert PREFIX + "stratum/group_0/k3" in first and PREFIX + "stratum/group_0/k3" not in last
    assert PREFIX + "stratum/group_1/k3" in last
    assert PREFIX + "stratum/group_0/k3" not in trainer.callback_metrics
    assert PREFIX + "stratum/group_1/k3" in trainer.callback_metrics


def test_bad_corrections_are_named_at_construction_and_missing_advantages_never_stop_training() -> None:
    class NoAdvantages(VersionedPolicy):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
            return super().training_step({k: v for k, v in batch.items() if k != "advantages"} | {
                "advantages": torch.ones(batch["input_ids"].shape[0])}, batch_idx)

        def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            batch.pop("advantages")  # the monitor reads the batch: it has none

    monitor = KLSampleTrainMonitor(corrections=["off_policy_mask:0.1"])
    trainer = quiet_trainer(max_steps=2, callbacks=[monitor])
    with pytest.warns(UserWarning, match=r"needs one advantage per datum: no advantage per datum under 'advantages'"):
        trainer.fit(NoAdvantages())  # a shadow metric: the run goes on
    assert trainer.global_step == 2
    assert monitor.last_metrics[PREFIX + "kl_sample_train_k3"] >= 0
    masked = PREFIX + "correction/off_policy_mask(threshold=0.1)/frac_seqs_masked"
    assert float(trainer.callback_metrics[masked]) == 1.0  # sequences it cannot judge are not kept, as the warning says
    with pytest.raises(ValueError, match="unknown method 'tis'"):
        KLSampleTrainMonitor(corrections=["tis"])
    with pytest.raises(TypeError, match="must be a list of specs"):
        KLSampleTrainMonitor(corrections="geo")  # type: ignore[arg-type]


def test_two_ranks_log_the_strata_and_shadow_metrics_of_the_global_window(two_rank_runs: tuple[Path, Any]) -> None:
    tmp_path = two_rank_runs[0] / "strata_and_shadow"  # two_ranks.strata_and_shadow: 2 steps of 2 micro-batches
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as handle:
        logged = [row for row in csv.DictReader(handle) if row.get(PREFIX + "stratum/pos_q1/k3")]
    assert [int(row["step"]) for row in logged] == [0, 1]
    for row in logged:
        step = int(row["step"])
        window = [r for rank in ranks for r in rank if r["step"] == step]  # rank 0's micro-batches first
        want = {**expected_strata(window, step), **expected_shadow(window, step)}
        assert want[PREFIX + "stratum/pos_q1/n_tokens"] > 0
        got = {key: float(row[key]) for key in row if row[key] and ("/stratum/" in key or "/correction/" in key)}
        assert_close(got, want)


def test_a_key_another_rank_could_not_use_is_still_said_from_the_global_sums() -> None:
    """Only rank 0 warns; a rank that turned policy_version off for its datums shows in the reduced sums."""
    from types import SimpleNamespace

    def sums(n: float) -> Any:
        return SimpleNamespace(n_tokens=n)

    monitor = KLSampleTrainMonitor()
    strata = {"lag_0": sums(60), "lag_1": sums(12), "group_0": sums(144), "group_other": sums(0), "lag_ahead": sums(0)}
    host = SimpleNamespace(
        totals={"n_action_tokens": 144.0}, strata=strata, by_lag={"0": sums(60), "1": sums(12)}
    )
    with pytest.warns(UserWarning, match=r"'policy_version' was usable for 72 of the step's 144 action tokens") as seen:
        report.partial_keys(monitor.warnings, monitor.keys, host, step=3)
    assert not any("'group'" in str(w.message) for w in seen)  # the groups covered every token
