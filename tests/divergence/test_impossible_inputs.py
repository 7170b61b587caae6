"""Inputs no sampled token can have are named as such, never read as a cause they mimic.

A trainer or sampler logprob of -inf or +inf on an action token, or one above 0 beyond rounding;
an entropy or varentropy that is negative, NaN or infinite, or that the token's own logprob rules out;
a mask that is negative or NaN; a batch without datums. Each is said (which field or side, how many),
and a step that has them cannot be trusted: the guard rail acts on it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor, token_logprobs
from loops_callbacks.divergence.batch import flatten_datums, flatten_padded
from loops_callbacks.divergence.guard_rail import GuardRail, impossible_inputs
from loops_callbacks.divergence.batch import read_step
from loops_callbacks.divergence.statistics import sampling_metrics
from loops_callbacks.divergence.report import MediaOptions, ReportOptions, StepReport, step_report
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from loops_callbacks.types import Datum, ModelInput
from tests.helpers import quiet_trainer

B, T, V = 32, 32, 50  # 1,024 positions
QUIET = MediaOptions(log_worst_tokens=False, log_histogram=False)


def drawn(temperature: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tokens drawn from the logits at ``temperature``; raw logprobs, equal to the trainer's; every field."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, T, V, generator=g)
    tokens = torch.multinomial(torch.softmax(logits / temperature, -1).reshape(-1, V), 1, generator=g).reshape(B, T)
    trainer = token_logprobs(logits, tokens, with_entropy=True)
    return {"sampler_logprobs": trainer.logprobs.clone(), "training_logprobs": trainer.logprobs,
            "training_entropy": trainer.entropy, "training_varentropy": trainer.varentropy, "mask": torch.ones(B, T),
            "logits": logits, "tokens": tokens}


def fields(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k not in ("logits", "tokens")}


def report_of(batch: dict[str, torch.Tensor], rail: GuardRail = GuardRail(max_sampling_z=6.0)) -> StepReport:  # noqa: B008
    host = DivergenceStats.from_batch(flatten_padded(**fields(batch))).to_host()
    return step_report(host, ReportOptions(media=QUIET), guard_rail=rail)


def assert_untrusted_not_sampling(report: StepReport, *said: str) -> None:
    """Named as impossible inputs (each of ``said`` in the text), untrusted, never a ``sampling`` cause."""
    assert report.diagnosis.cause == "impossible_inputs", report.diagnosis.message
    text = " ".join(report.problems.values())
    for part in said:
        assert part in text, text
    assert report.untrusted is not None and report.exceeds.startswith("the step cannot be trusted"), report.exceeds
    assert not math.isinf(report.scalars.get("sampling_z", 0.0)), report.scalars


# ------------------------------------------------------------------ 1. the entropy fields


def test_a_negated_entropy_is_named_never_sampling() -> None:
    batch = drawn()
    batch["training_entropy"] = -batch["training_entropy"]
    report = report_of(batch)
    assert_untrusted_not_sampling(report, "'training_entropy'", "negative")
    assert "of 1024 masked-in positions" in report.problems["entropy_invalid"]


@pytest.mark.parametrize("value", [-1.0, 0.0], ids=["negative", "zero"])
def test_a_negative_or_all_zero_varentropy_is_named_never_sampling(value: float) -> None:
    batch = drawn()
    batch["training_varentropy"] = torch.full_like(batch["training_varentropy"], value)
    report = report_of(batch)
    assert_untrusted_not_sampling(report, "'training_varentropy'" if value < 0 else "rule out")
    assert "effective temperature nan" not in (report.exceeds or "")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_entropies_are_counted_and_named_not_dropped_or_called_missing(value: float) -> None:
    batch = drawn()
    for name in ("training_entropy", "training_varentropy"):
        changed = dict(batch)
        changed[name] = batch[name].clone()
        changed[name].view(-1)[::2] = value  # half of them
        report = report_of(changed)
        assert_untrusted_not_sampling(report, f"'{name}'", "512 of 1024 masked-in positions")
        kind = "NaN" if math.isnan(value) else "inf"
        assert f"512 {kind}" in " ".join(report.problems.values()), report.problems


def test_every_entropy_infinite_is_not_said_missing() -> None:
    batch = drawn()
    batch["training_entropy"] = torch.full_like(batch["training_entropy"], math.inf)
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_sampling_z=6.0, on_exceed="warn"), media=QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=1, callbacks=[monitor]).fit(Returns(fields(batch)))
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "is set but the step has no" in m], said
    assert [m for m in said if "'training_entropy'" in m and "inf" in m], said


def test_swapped_entropy_and_varentropy_are_ruled_out_by_the_tokens_own_logprobs() -> None:
    batch = drawn()
    batch["training_entropy"], batch["training_varentropy"] = batch["training_varentropy"], batch["training_entropy"]
    report = report_of(batch)
    assert_untrusted_not_sampling(report, "rule out")


def test_a_point_mass_with_a_drawn_token_of_logprob_minus_7_is_ruled_out_and_z_is_never_infinite() -> None:
    batch = drawn()
    batch["training_entropy"] = torch.zeros(B, T)
    batch["training_varentropy"] = torch.zeros(B, T)
    batch["training_logprobs"] = torch.zeros(B, T)
    batch["training_logprobs"][3, 4] = -7.0
    batch["sampler_logprobs"] = batch["training_logprobs"].clone()
    report = report_of(batch)
    assert_untrusted_not_sampling(report, "1 of 1024 masked-in positions", "rule out")
    # a token too unlikely for the rounding allowed to register (e^-30) still leaves no varentropy to scale by
    batch["training_logprobs"][3, 4] = batch["sampler_logprobs"][3, 4] = -30.0
    report = report_of(batch)
    assert_untrusted_not_sampling(report, "'training_varentropy' is 0 at every one of the 1024 positions checked")
    assert math.isnan(report.scalars["sampling_z"]) and "rule out" not in report.untrusted
    # and the check's own numbers: no variance to scale by is no number, not an infinite one
    found = sampling_metrics({"n_sampling_tokens": 2.0, "sum_sampling_gap": -14.0, "sum_sampling_entropy": 0.0,
                              "sum_sampling_varentropy": 0.0}, {"max_sampling_gap": -0.0, "neg_min_sampling_gap": 7.0})
    assert math.isnan(found["sampling_z"]) and math.isnan(found["sampling_z_trimmed"]), found


def test_fields_of_another_temperature_are_not_blamed_on_the_sampler_alone() -> None:
    """Entropies of logits / 0.7 beside logprobs of the logits read as tokens drawn flatter: no check tells the
    two apart, so the finding says both what was sampled and where the fields came from are to check."""
    batch = drawn()
    sharp = token_logprobs(batch["logits"] / 0.7, batch["tokens"], with_entropy=True)
    batch["training_entropy"], batch["training_varentropy"] = sharp.entropy, sharp.varentropy
    report = report_of(batch, GuardRail())
    assert not report.problems
    assert report.diagnosis.cause == "sampling" and math.isfinite(report.scalars["sampling_z"])
    assert "'training_entropy' and 'training_varentropy'" in report.diagnosis.message, report.diagnosis.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_no_token_of_any_distribution_rules_its_own_fields_out(dtype: torch.dtype, cast: torch.dtype | None) -> None:
    """The bound holds for every token a distribution has, not only for likely draws: uniform, uniform on a few,
    near a point mass, flat to very peaked; the logits in any dtype, the fields kept in bf16 or not."""
    vocabulary, positions = 96, 8
    logits = torch.randn(positions, vocabulary, generator=torch.Generator().manual_seed(2))
    logits *= torch.tensor([0.0, 0.01, 1.0, 5.0, 20.0, 100.0, 1.0, 1.0])[:, None]
    logits[6] = torch.where(torch.arange(vocabulary) < 7, 0.0, -1e9)  # uniform on 7 tokens
    logits[7, 0] = 1e3  # a point mass but for rounding
    every = logits.to(dtype)[:, None, :].expand(positions, vocabulary, vocabulary).reshape(1, -1, vocabulary)
    out = token_logprobs(every, torch.arange(vocabulary).repeat(positions)[None], with_entropy=True)
    t, h, v = (x if cast is None else x.to(cast) for x in out)
    drawable = (t > -1e3).float()  # the tokens outside the 7 have logprobs of about -1e9: never drawn
    assert not report_of({"sampler_logprobs": t, "training_logprobs": t, "training_entropy": h,
                          "training_varentropy": v, "mask": drawable}, GuardRail()).problems


def test_honest_fields_have_no_problem() -> None:
    for temperature in (1.0, 0.7):
        report = report_of(drawn(temperature, seed=1), GuardRail())
        assert not report.problems and report.untrusted is None
    assert report.diagnosis.cause == "sampling"  # drawn at 0.7: the check still finds it


def test_a_negated_entropy_stops_the_run_as_untrusted() -> None:
    batch = drawn()
    batch["training_entropy"] = -batch["training_entropy"]
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_sampling_z=6.0, on_exceed="stop"), media=QUIET)
    trainer = quiet_trainer(max_steps=3, callbacks=[monitor])
    with pytest.warns(UserWarning, match="'training_entropy'"):
        trainer.fit(Returns(fields(batch)))
    assert trainer.global_step == 1 and "cannot be trusted" in monitor.stop_reason
    assert monitor.last_diagnosis.cause == "impossible_inputs" and "effective temperature" not in monitor.stop_reason


# ------------------------------------------------------------------ 2. infinite and positive logprobs


@pytest.mark.parametrize(("key", "value", "said"), [
    ("training_logprobs", -math.inf, "2 of 1024 action tokens have a trainer logprob of -inf"),
    ("sampler_logprobs", -math.inf, "2 of 1024 action tokens have a sampler logprob of -inf"),
    ("training_logprobs", math.inf, "2 of 1024 action tokens have a trainer logprob of +inf"),
    ("sampler_logprobs", math.inf, "2 of 1024 action tokens have a sampler logprob of +inf"),
])
def test_an_infinite_logprob_on_two_tokens_is_said_and_untrusted(key: str, value: float, said: str) -> None:
    batch = drawn()
    batch[key] = batch[key].clone()
    batch[key][0, 3] = batch[key][5, 7] = value
    report = report_of(batch, GuardRail(max_kl=10.0))
    assert report.scalars["n_skipped_nonfinite"] == 2.0
    assert report.diagnosis.cause == "impossible_inputs" and said in report.diagnosis.message
    assert report.untrusted is not None and said in report.untrusted, report.untrusted


@pytest.mark.parametrize(("key", "value"), [("training_logprobs", 0.5), ("sampler_logprobs", 0.5)])
def test_a_positive_logprob_beyond_rounding_is_untrusted(key: str, value: float) -> None:
    batch = drawn()
    batch[key] = batch[key].clone()
    batch[key][1, 1] = value
    report = report_of(batch, GuardRail(max_kl=10.0))
    assert report.diagnosis.cause == "impossible_inputs" and report.untrusted is not None


def test_a_positive_logprob_within_rounding_is_no_problem() -> None:
    batch = {k: v for k, v in drawn().items() if k not in ("training_entropy", "training_varentropy")}
    batch["training_logprobs"] = batch["training_logprobs"].clone()
    batch["training_logprobs"][1, 1] = 5e-4  # bf16 log_softmax of a near-certain token
    assert not report_of(batch, GuardRail()).problems


class Returns(pl.LightningModule):
    """``training_step`` returns ``fields`` (tensors, detached) and a loss, every step."""

    def __init__(self, fields: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.fields = fields
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=None)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = {("logprobs" if k == "sampler_logprobs" else k): v for k, v in self.fields.items()}
        return {"loss": self.weight * 0.0, **out}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_trainer_minus_inf_on_two_tokens_warns_and_stops_the_run() -> None:
    batch = drawn()
    batch["training_logprobs"] = batch["training_logprobs"].clone()
    batch["training_logprobs"][0, 3] = batch["training_logprobs"][5, 7] = -math.inf
    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=10.0, on_exceed="stop"), media=QUIET)
    trainer = quiet_trainer(max_steps=3, callbacks=[monitor])
    with pytest.warns(UserWarning, match="2 of 1024 action tokens have a trainer logprob of -inf") as caught:
        trainer.fit(Returns(fields(batch)))
    assert trainer.global_step == 1 and "cannot be trusted" in monitor.stop_reason
    assert monitor.last_diagnosis.cause == "impossible_inputs"
    example = [str(w.message) for w in caught if "have a trainer logprob of -inf" in str(w.message)
               and "Signaling" not in str(w.message)]
    assert len(example) == 1 and "key 'training_logprobs', e.g. -inf at datum 0, position 3" in example[0], example


def test_impossible_inputs_are_untrusted_without_a_diagnosis_too() -> None:
    batch = drawn()
    batch["training_logprobs"] = batch["training_logprobs"].clone()
    batch["training_logprobs"][0, 3] = -math.inf
    host = DivergenceStats.from_batch(flatten_padded(**fields(batch)), StatisticsOptions(diagnose=False)).to_host()
    assert list(impossible_inputs(host)) == ["trainer_neg_inf"]
    report = step_report(host, ReportOptions(media=QUIET, diagnose=False), guard_rail=GuardRail(max_kl=10.0))
    assert report.untrusted is not None and report.exceeds is not None


# ------------------------------------------------------------------ 3. the mask


@pytest.mark.parametrize(("value", "shown"), [(-1.0, "-1"), (math.nan, "nan")])
def test_a_negative_or_nan_mask_is_refused_naming_the_row_position_and_count(value: float, shown: str) -> None:
    batch = fields(drawn())
    mask = torch.ones(B, T)
    mask[2, 5] = mask[4, 1] = value
    with pytest.raises(ValueError, match=rf"'mask'.*row 2, position 5 is {shown}.*2 such values"):
        flatten_padded(**(batch | {"mask": mask}))
    assert mask[2, 5].item() != 1.0 or math.isnan(value)  # the caller's mask is not modified


def test_a_negative_or_nan_datum_mask_is_refused_naming_the_datum() -> None:
    data = [Datum(ModelInput.from_ints([1, 2, 3]), {"logprobs": [-1.0, -1.0, -1.0], "mask": mask})
            for mask in ([1.0, 1.0, 0.0], [1.0, -1.0, None])]
    with pytest.raises(ValueError, match=r"datum 1, key 'mask': position 1 is -1.*2 such values"):
        flatten_datums(data, [[-1.0] * 3] * 2)
    data[1].loss_fn_inputs["mask"] = [1.0, None, 1.0]
    with pytest.raises(ValueError, match=r"datum 1, key 'mask': position 1 is nan \(None in a list reads as NaN\)"):
        flatten_datums(data, [[-1.0] * 3] * 2)


def test_a_mask_of_weights_and_bools_is_accepted() -> None:
    batch = fields(drawn())
    for mask in (torch.full((B, T), 0.5), torch.ones(B, T, dtype=torch.bool), torch.ones(B, T, dtype=torch.long)):
        assert flatten_padded(**(batch | {"mask": mask})).active.all()


def test_a_mask_that_could_not_be_read_on_the_host_is_refused_at_the_steps_one_transfer() -> None:
    """On an accelerator the mask is not read per micro-batch (that would wait for the device): the step's
    statistics count the refused positions and the report refuses them."""
    batch = fields(drawn())
    flat = flatten_padded(**batch)
    refused = torch.zeros_like(flat.masked_in)
    refused[40] = refused[41] = True
    flat = dataclasses.replace(flat, mask_refused=refused)
    host = DivergenceStats.from_batch(flat).to_host()
    with pytest.raises(ValueError, match=r"'mask' holds 2 negative or NaN values.*row 1, position 8"):
        step_report(host, ReportOptions(media=QUIET), guard_rail=GuardRail())


# ------------------------------------------------------------------ 5. a batch without datums


@pytest.mark.parametrize("batch", [[], ()])
def test_an_empty_list_of_datums_says_the_batch_holds_no_datums(batch: Any) -> None:
    with pytest.raises(ValueError, match=f"the batch is an empty {type(batch).__name__}: it holds no datums"):
        read_step({"training_logprobs": []}, batch)


def test_an_empty_micro_batch_of_datums_beside_padded_fields_or_under_data_is_read_as_nothing() -> None:
    """A rank's or micro-batch's share may hold no datums: nothing to judge, never an error (it would leave the
    other ranks waiting in the step's reduction)."""
    assert read_step({"training_logprobs": [], "data": []}, {}).n_datums == 0
    padded = {"training_logprobs": torch.zeros(1, 2), "logprobs": torch.zeros(1, 2), "mask": torch.ones(1, 2)}
    assert read_step(padded, []).n_datums == 1


def test_the_plain_function_logs_an_infinite_logprob_naming_the_side(caplog: pytest.LogCaptureFixture) -> None:
    from loops_callbacks import loops_compute_kl_sample_train

    data = [Datum(ModelInput.from_ints([1, 2, 3]), {"logprobs": [-1.0, -1.0, -1.0], "mask": [1.0, 1.0, 1.0]})]
    with caplog.at_level("WARNING", logger="loops_callbacks"):
        metrics = loops_compute_kl_sample_train(data, [[-1.0, -math.inf, -1.0]])
    assert metrics["optim/train-sample-div/n_skipped_nonfinite"] == 1.0
    assert "1 of 3 action tokens have a trainer logprob of -inf" in caplog.text
