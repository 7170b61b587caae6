"""On a CUDA device: the same numbers as on the CPU, and no host synchronization until a log.

Skipped (with the reason) where no CUDA device is present; run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.divergence.batch import flatten_padded
from loops_callbacks.divergence.statistics import DivergenceStats, StatisticsOptions
from tests.helpers import (
    RecordingLogger,
    TinyPolicy,
    assert_metrics_equal,
    expected_metrics,
    quiet_trainer,
    scalars,
)
from tests.oracle import PREFIX

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


def host_of(device: str) -> Any:
    flat = flatten_padded(**padded_batch(device), with_tokens=True)
    return DivergenceStats.from_batch(flat, StatisticsOptions(top_n=20)).to_host()


def test_cuda_statistics_equal_the_cpu_ones() -> None:
    from loops_callbacks.divergence.statistics import scalar_metrics

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
        options = StatisticsOptions(top_n=20, sample_size=1000)
        stats = DivergenceStats.from_batch(flat, options, generator=torch.Generator("cuda"))
        stats = stats.merge(DivergenceStats.from_batch(flat, options))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.to_host().totals["n_action_tokens"] > 0


def test_nan_advantages_are_counted_on_the_gpu_without_a_host_sync() -> None:
    """The monitor's path (``read_step``, then the statistics) counts NaN advantages on the device; the
    count reaches the host with the rest in ``to_host``, and equals the CPU's."""
    from loops_callbacks.divergence.batch import read_step

    batch = padded_batch("cuda")
    advantages = batch["advantages"][:, None].expand_as(batch["mask"]).clone()
    advantages[0] = float("nan")
    advantages[1, ::3] = float("nan")
    batch["advantages"] = advantages
    output = {"training_logprobs": batch.pop("training_logprobs")}
    step = {"logprobs": batch.pop("sampler_logprobs"), **batch}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flat = read_step(output, step)
        stats = DivergenceStats.from_batch(flat, StatisticsOptions(top_n=20))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = stats.to_host()
    want = int((advantages.isnan() & (batch["mask"] > 0)).sum())
    cpu = DivergenceStats.from_batch(
        read_step({k: v.cpu() for k, v in output.items()}, {k: v.cpu() for k, v in step.items()})
    ).to_host()
    assert 0 < want == host.totals["n_advantage_nan"] == cpu.totals["n_advantage_nan"]
    assert host.totals["n_masked_in"] == cpu.totals["n_masked_in"] == int((batch["mask"] > 0).sum())


def test_loops_functions_on_cuda_tensors() -> None:
    from loops_callbacks import loops_compute_kl_sample_train
    from loops_callbacks.divergence.batch import flatten_datums
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
        DivergenceStats.from_batch(flatten_datums(d, t, with_tokens=True), StatisticsOptions(top_n=20)).to_host().worst
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
        assert_metrics_equal(scalars(metrics), expected_metrics(window))


@contextlib.contextmanager
def host_waits() -> Iterator[list[str]]:
    """The host synchronizations inside the block, one message each (sync debug mode ``warn``)."""
    torch.cuda.synchronize()
    waits: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits += [str(w.message) for w in caught if "synchronizing CUDA operation" in str(w.message)]


class _CountedMonitor(KLSampleTrainMonitor):
    """Counts the host synchronizations inside each call of the hook (sync debug mode ``warn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[int] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        with host_waits() as waits:
            super().on_train_batch_end(*args, **kwargs)
        self.waits.append(len(waits))


def test_a_logged_step_waits_for_the_gpu_once_and_another_step_never() -> None:
    monitor = _CountedMonitor()
    quiet_trainer(accelerator="gpu", max_steps=4, log_every_n_steps=2, logger=RecordingLogger(),
                  callbacks=[monitor]).fit(TinyPolicy())
    assert monitor.waits == [0, 1, 0, 1]  # steps 1 and 3 are logged: the one transfer of their statistics


# --- the reference scorer on the GPU --------------------------------------------------------------


def _tiny_llama(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def _sequences(count: int = 48, vocab: int = 512) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 200, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


class _HeadLM(torch.nn.Module):
    """Embedding, one MLP block, an exposed output head: no host synchronisation of its own."""

    def __init__(self, vocab: int = 512, width: int = 64) -> None:
        super().__init__()
        self.embed, self.mlp, self.lm_head = (
            torch.nn.Embedding(vocab, width),
            torch.nn.Linear(width, width),
            torch.nn.Linear(width, vocab, bias=False),
        )

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.lm_head(x + torch.relu(self.mlp(x)))


@pytest.mark.parametrize("output_head", [True, False])
def test_reference_scoring_never_waits_for_the_gpu_between_batches(output_head: bool) -> None:
    from loops_callbacks.reference.clients import TorchSamplingClient
    from loops_callbacks.reference.packing import PackedTokens

    torch.manual_seed(0)
    client = TorchSamplingClient(_HeadLM(), device="cuda", max_tokens_per_batch=1024, output_head=output_head)
    packed = PackedTokens.from_sequences(_sequences())
    client.score_packed(packed)  # the one-time head check reads a number back
    with host_waits() as waits:
        values = client.score_packed(packed)  # ids in, every batch built and scattered on the device
    # one wait in all: after the last batch, the check that every value is a logprob reads one boolean
    assert len(waits) == 1, waits
    assert values.is_cuda and values.dtype == torch.float32 and values.numel() == packed.num_tokens
    assert client.path == ("output_head" if output_head else "logits")


def test_output_head_path_on_the_gpu_in_bfloat16() -> None:
    from loops_callbacks.reference.clients import TorchSamplingClient

    model = _tiny_llama(torch.bfloat16).cuda()
    prompts = _sequences(16)
    head = TorchSamplingClient(model)
    general = TorchSamplingClient(model, output_head=False)
    got, want = head.compute_logprobs_batch(prompts), general.compute_logprobs_batch(prompts)
    assert head.path == "output_head", head.why_not_head
    worst = max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x[1:], y[1:]))
    assert worst < 0.1  # the same bf16 logits; float32 log-softmax either way


def _dpo_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], beta: float = 0.1) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, batch["target_tokens"].unsqueeze(-1)).squeeze(-1)
    delta = ((logprobs - batch["ref_logprobs"]) * batch["weights"]).sum(-1)
    return -torch.nn.functional.logsigmoid(beta * (delta[0::2] - delta[1::2])).mean()


class _ShardedDPO(pl.LightningModule):
    """A tiny Llama built in ``configure_model`` and sharded there (FSDP2) or by the strategy (FSDP)."""

    def __init__(self, fsdp2: bool) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = _tiny_llama()
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return _dpo_loss(self(batch["input_ids"]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # an optimizer with state: Lightning's FSDP resume from a full checkpoint reads its first entry
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _strategy(fsdp2: bool) -> Any:
    import functools

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if fsdp2:
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    layer = type(_tiny_llama().model.layers[0])
    return FSDPStrategy(auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer}))


@pytest.mark.parametrize("fsdp2", [False, True], ids=["fsdp", "fsdp2"])
def test_fsdp_with_configure_model_is_its_own_reference_on_one_gpu(tmp_path: Any, fsdp2: bool) -> None:
    from loops_callbacks.data import DPODataModule, dpo_pair_datums
    from loops_callbacks.reference.clients import TorchSamplingClient

    sequences = _sequences(16)
    data = [
        datum
        for i in range(0, 16, 2)
        for datum in dpo_pair_datums(sequences[i][:1] + sequences[i], sequences[i][:1] + sequences[i + 1], 1)
    ]

    def run(ckpt_path: str | None = None, max_steps: int = 2) -> tuple[pl.Trainer, DPODataModule]:
        module = DPODataModule(data, batch_size=2, progress=False)
        trainer = pl.Trainer(
            default_root_dir=str(tmp_path), accelerator="gpu", devices=1, strategy=_strategy(fsdp2),
            max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(_ShardedDPO(fsdp2), datamodule=module, ckpt_path=ckpt_path)
        return trainer, module

    trainer, module = run()
    assert module.reference_report.source == "scored"
    want = TorchSamplingClient(_tiny_llama().cuda()).compute_logprobs_batch([d.model_input for d in data])
    for datum, expected in zip(module.scored_pairs.datums(), want):
        row = datum.loss_fn_inputs["ref_logprobs"]
        assert abs(row[:-1] - torch.tensor(expected[1:]).numpy()).max() < 1e-4
    # a resumed run (under FSDP the weights are restored after the strategy's setup) takes the cache
    ckpt = str(tmp_path / "sharded.ckpt")
    trainer.save_checkpoint(ckpt)
    _, resumed = run(ckpt_path=ckpt, max_steps=3)
    assert resumed.reference_report.source == "cache"


def test_gpu_profile_runs_and_names_each_path() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_profile.py"), "--quick"], cwd=root,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for start in ("bare forward ", "forward + float32 log-softmax ", "general path ", "output-head path ",
                  "monitor, logged step 49: "):
        assert any(line.startswith(start) for line in done.stdout.splitlines()), done.stdout
    assert "kernel launches" in done.stdout


def test_a_fleet_server_synced_over_nccl_samples_the_new_weights(tmp_path: Any) -> None:
    """``VLLMServerFleet(transport="nccl")``: vLLM's own NCCL engine (``WeightTransferTrainerFactory``) from this
    process to one server on this GPU, started with ``--weight-transfer-config '{"backend": "nccl"}'``; the
    server's logprobs are then the pushed model's. Needs vLLM's CUDA build; never run on the CPU-only machines."""
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from loops_callbacks import token_logprobs
    from loops_callbacks.integrations.vllm import LocalVLLMServers, VLLMServerFleet

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "tiny")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(tmp_path / "tiny")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn_like(parameter))
    model = model.cuda()
    with LocalVLLMServers(tmp_path / "tiny", count=1, workdir=tmp_path / "servers",
                          extra_args=["--weight-transfer-config", '{"backend": "nccl"}']) as servers:
        fleet = VLLMServerFleet(servers.urls, transport="nccl")
        fleet.push(model, version=1)
        assert fleet.last_sync.phases[servers.urls[0]]["transfer"] > 0
        batch = fleet.rollouts([[5, 6, 7], [8, 9]], max_tokens=4, n=2, device="cuda")
        with torch.no_grad():
            trainer = token_logprobs(model(batch["input_ids"]).logits, batch["target_tokens"])
        mask = batch["mask"] > 0
        assert batch["policy_version"].tolist() == [1] * 4
        assert (trainer - batch["logprobs"])[mask].abs().max().item() < 1e-3
        fleet.close()
