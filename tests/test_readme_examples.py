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
