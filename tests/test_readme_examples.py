"""The README's examples run as written: each python block is read from README.md and executed in a temporary
working directory, and says what the README says it does."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.monitor import MediaOptions
from tests.helpers import TinyPolicy, quiet_trainer
from tests.oracle import PREFIX

README = Path(__file__).resolve().parents[1] / "README.md"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def python_block(marker: str) -> str:
    """The one ```python block of the README that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"{len(found)} python blocks of README.md contain {marker!r}"
    return found[0]


def run(block: str) -> tuple[dict[str, Any], str]:
    namespace: dict[str, Any] = {"__name__": "readme"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), namespace)
    return namespace, printed.getvalue()


def test_the_readme_is_short_and_gives_two_set_up_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    commands = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert len(commands) == 2 and all(c.startswith("python3 -m venv .venv && . .venv/bin/activate && ") for c in commands)
    assert ".ci/run" not in text and "From the checkout root" in text


def test_the_rl_example_trains_monitors_and_names_the_bf16_sampler_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # its logger's directory is relative
    namespace, printed = run(python_block("class GRPO(LightningModule):"))
    monitor = namespace["monitor"]
    assert monitor.guard_rail.judged_steps == 4 and monitor.last_diagnosis.cause == "precision", printed
    assert "likely cause: numerical precision (the engines' dtypes, kernels or reduction order differ)" in printed
    assert printed.strip().endswith("Guard rail: no exceedance (kl_sample_train_k3 <= 0.05 on every judged step)")
    assert list((tmp_path / "runs" / "my_run").rglob("metrics.csv"))


def test_the_rl_example_without_its_sync_is_stopped_and_named_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's claim: stop the sampler's sync and the versions say so from the first logged step behind
    (step 4: lag 4), and the guard rail stops the run, named stale."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    block = python_block("class GRPO(LightningModule):").replace(
        "self.sampler.load_state_dict(self.policy.state_dict())", "pass"
    ).replace("self.version = self.trainer.global_step", "pass")
    namespace, printed = run(block)
    monitor = namespace["monitor"]
    assert monitor.history.causes["stale"][1] == 4, printed
    assert monitor.stop_reason is not None and "the sampler's weights are out of date: every datum sampled with " \
        "weights" in monitor.stop_reason, printed


def test_the_rl_example_whose_sync_fails_while_its_version_counts_is_stopped_with_a_hint_to_check_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's claim: a sync that fails while policy_version still counts reads as unrelated distributions,
    with a hint to check that the sampler loaded the trainer's weights at all."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    block = python_block("class GRPO(LightningModule):").replace(
        "self.sampler.load_state_dict(self.policy.state_dict())", "pass")
    stop_reason = run(block)[0]["monitor"].stop_reason
    assert stop_reason is not None and "unrelated distributions" in stop_reason, stop_reason
    assert "that the sampler loaded the trainer's weights at all" in stop_reason, stop_reason


def test_the_dpo_example_scores_caches_and_a_rerun_loads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    block = python_block("DPODataModule(path=")
    first, _ = run(block)
    assert first["data"].reference_report.source == "scored"
    second, _ = run(block)  # the same data and reference: loaded, not scored again
    assert second["data"].reference_report.source == "cache"


class PromptZeros(TinyPolicy):
    """The contract's batch: sampler logprobs 0 at prompt positions, the mask in ``mask_dtype``, the
    sampler's logprobs in ``logprob_dtype`` (the float32 run gets the same bf16-rounded values)."""

    def __init__(self, mask_dtype: torch.dtype, logprob_dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.mask_dtype, self.logprob_dtype = mask_dtype, logprob_dtype

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        out = super().training_step(batch, batch_idx)
        mask = batch["mask"] > 0
        sampler = torch.where(mask, out["logprobs"], 0.0).to(torch.bfloat16).to(self.logprob_dtype)
        return {**out, "logprobs": sampler, "mask": mask.to(self.mask_dtype)}


def test_bool_masks_and_bf16_sampler_logprobs_give_the_float_numbers() -> None:
    metrics = []
    for mask_dtype, logprob_dtype in ((torch.float32, torch.float32), (torch.bool, torch.bfloat16)):
        monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False), log_every_n_steps=1)
        quiet_trainer(max_steps=2, callbacks=[monitor]).fit(PromptZeros(mask_dtype, logprob_dtype))
        metrics.append(monitor.last_metrics)
    assert metrics[0] and metrics[0][PREFIX + "kl_sample_train_k3"] > 0
    assert metrics[1] == metrics[0]
