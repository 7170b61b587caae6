"""The README's "Monitor an RL run" examples run as written: each block is read from README.md and executed."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.demo.model import TinyCausalLM
from tests.helpers import TinyPolicy, quiet_trainer
from tests.oracle import PREFIX

K3 = PREFIX + "kl_sample_train_k3"

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


def test_the_trainer_block_builds_a_monitored_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # its loggers' directories are relative
    namespace, _ = run(python_block("trainer = Trainer(callbacks=[KLSampleTrainMonitor"))
    assert any(isinstance(callback, KLSampleTrainMonitor) for callback in namespace["trainer"].callbacks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_step_block_imports_what_it_calls(dtype: torch.dtype) -> None:
    namespace, _ = run(python_block("def training_step(self, batch, batch_idx):"))
    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_seq_len=8).to(dtype)
    tokens = torch.randint(0, 11, (3, 7))
    batch = {"input_ids": tokens[:, :-1], "target_tokens": tokens[:, 1:]}
    out = namespace["training_step"](model, batch, 0)
    want = model(batch["input_ids"]).float().log_softmax(-1).gather(-1, batch["target_tokens"][..., None])[..., 0]
    assert out["training_logprobs"].dtype == torch.float32
    assert torch.equal(out["training_logprobs"], want)


def test_the_datum_block_prints_the_value_its_comment_gives() -> None:
    block = python_block("ModelInput.from_ints")
    claimed = re.search(r"print\(.*\)\s*#\s*([-0-9.e]+)\.\.\.", block)
    assert claimed, "the block's print has no '# <value>...' comment"
    _, printed = run(block)
    assert printed.strip().startswith(claimed.group(1)), (printed, claimed.group(1))


class PromptZeros(TinyPolicy):
    """The README's batch: sampler logprobs 0 at prompt positions, the mask in ``mask_dtype``, the
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
        monitor = KLSampleTrainMonitor(log_every_n_steps=1, log_worst_tokens=False)
        quiet_trainer(max_steps=2, callbacks=[monitor]).fit(PromptZeros(mask_dtype, logprob_dtype))
        metrics.append(monitor.last_metrics)
    assert metrics[0] and metrics[0][K3] > 0
    assert metrics[1] == metrics[0]
