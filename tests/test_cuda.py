"""On a CUDA device: the same numbers as on the CPU, and no host synchronization until a log.

Skipped (with the reason) where no CUDA device is present; run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.action_tokens import flatten_padded
from loops_callbacks.divergence.statistics import DivergenceStats
from tests.lightning_helpers import RecordingLogger, TinyPolicy, expected_metrics, quiet_trainer
from tests.oracle import PREFIX
from tests.test_rl_metrics import assert_metrics_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def padded_batch(device: str, batch: int = 64, length: int = 256) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    sampler = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 5
    return {
        "sampler_logprobs": sampler.to(device),
        "training_logprobs": (sampler + 0.05 * torch.randn(batch, length, generator=generator, dtype=torch.float64))
        .to(torch.bfloat16)
        .to(device),
        "mask": (torch.rand(batch, length, generator=generator) > 0.2).float().to(device),
        "advantages": torch.randn(batch, generator=generator).to(device),
        "input_ids": torch.randint(0, 1000, (batch, length), generator=generator).to(device),
        "target_tokens": torch.randint(0, 1000, (batch, length), generator=generator).to(device),
    }


def host_of(device: str, **kwargs: Any) -> Any:
    flat = flatten_padded(**padded_batch(device), with_tokens=True)
    return DivergenceStats.from_batch(flat, top_n=20, **kwargs).to_host()


def test_cuda_statistics_equal_the_cpu_ones() -> None:
    from loops_callbacks.divergence.metrics import scalar_metrics

    cpu, cuda = host_of("cpu"), host_of("cuda")
    assert_metrics_equal(scalar_metrics(cuda), scalar_metrics(cpu))
    assert (cuda.worst == cpu.worst).all()
    assert (cuda.diffs == cpu.diffs).all()


def test_no_host_sync_until_to_host() -> None:
    batch = padded_batch("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flat = flatten_padded(**batch, with_tokens=True)
        stats = DivergenceStats.from_batch(flat, top_n=20, sample_size=1000, generator=torch.Generator("cuda"))
        stats = stats.merge(DivergenceStats.from_batch(flat, top_n=20, sample_size=1000))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.to_host().totals["n_action_tokens"] > 0


def test_loops_functions_on_cuda_tensors() -> None:
    from loops_callbacks import loops_compute_kl_sample_train
    from loops_callbacks.divergence.action_tokens import flatten_datums
    from loops_callbacks.types import Datum, ModelInput

    batch = padded_batch("cuda", batch=8, length=32)
    datums = [
        Datum(ModelInput.from_ints(batch["input_ids"][i].tolist()),
              {"logprobs": batch["sampler_logprobs"][i], "mask": batch["mask"][i]})
        for i in range(8)
    ]
    on_cpu = [Datum(d.model_input, {k: v.cpu() for k, v in d.loss_fn_inputs.items()}) for d in datums]
    trainer = batch["training_logprobs"]
    assert_metrics_equal(loops_compute_kl_sample_train(datums, trainer),
                         loops_compute_kl_sample_train(on_cpu, trainer.cpu()))
    rows = [
        DivergenceStats.from_batch(flatten_datums(d, t, with_tokens=True), top_n=20).to_host().worst
        for d, t in ((datums, trainer), (on_cpu, trainer.cpu()))
    ]
    assert (rows[0] == rows[1]).all()


def test_monitor_on_gpu_with_bf16_mixed_and_accumulation() -> None:
    model, logger = TinyPolicy(), RecordingLogger()
    trainer = quiet_trainer(
        accelerator="gpu", precision="bf16-mixed", max_steps=3, accumulate_grad_batches=2, logger=logger,
        callbacks=[KLSampleTrainMonitor()],
    )
    trainer.fit(model)
    ours = [(step, m) for step, m in logger.calls if PREFIX + "kl_sample_train_k3" in m]
    assert [step for step, _ in ours] == [0, 1, 2]
    for step, metrics in ours:
        window = [r for r in model.recorded if r["step"] == step]
        got = {k: v for k, v in metrics.items() if isinstance(v, float)}
        assert_metrics_equal(got, expected_metrics(window))
