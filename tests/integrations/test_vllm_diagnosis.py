"""What the monitor says about a real vLLM engine's rollouts: what was sampled, and a stale prefix cache.

The session's engine reports raw logprobs (vLLM's default ``logprobs_mode``). Sampled at temperature
0.7 its logprobs still equal the trainer's (a Hugging Face float32 forward on the same weights), and
only the check of what was sampled can tell: the monitor names ``sampling``. An engine reporting
processed logprobs at 0.7 (started in a subprocess: the logprobs mode is an engine setting) reports
what it drew from, which the temperature-1 trainer does not match: a ``temperature``, not sampling.
Weights reloaded without a prefix-cache reset, on prompts sharing two full KV blocks, are named from
the engine's own account.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

vllm = pytest.importorskip("vllm")

from loops_callbacks import KLSampleTrainMonitor, token_logprobs  # noqa: E402
from loops_callbacks.divergence.monitor import MediaOptions  # noqa: E402
from loops_callbacks.integrations import vllm as integration  # noqa: E402
from loops_callbacks.integrations.vllm import rollouts as vllm_rollouts  # noqa: E402
from loops_callbacks.integrations.vllm import VLLMWeightSync, generate_rollouts  # noqa: E402
from tests.helpers import quiet_trainer  # noqa: E402
from tests.integrations.conftest import VOCAB  # noqa: E402
from tests.integrations.test_vllm import BLOCK, random_prompts  # noqa: E402


class Replay(LightningModule):
    """Each batch is one step's rollouts, sampled with the trainer's current weights (their version is the
    step's); ``training_step`` adds the trainer's logprobs and entropies."""

    def __init__(self, model: Any, steps: list[dict[str, Any]]) -> None:
        super().__init__()
        self.model, self.steps = model, steps
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.steps, batch_size=None, collate_fn=lambda step: step)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        with torch.no_grad():
            scored = token_logprobs(self.model(batch["input_ids"]).logits, batch["target_tokens"], with_entropy=True)
        current = torch.full_like(batch["policy_version"], self.global_step)
        return {"loss": self.anchor * 0.0, **batch, **scored.outputs, "policy_version": current}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.anchor], lr=0.0)


def monitored(model: Any, steps: list[dict[str, Any]]) -> KLSampleTrainMonitor:
    monitor = KLSampleTrainMonitor(media=MediaOptions(log_worst_tokens=False, log_histogram=False))
    quiet_trainer(max_steps=len(steps), callbacks=[monitor]).fit(Replay(model, steps))
    return monitor


def rollouts(engine: Any, temperature: float, seed: int, sync: VLLMWeightSync) -> dict[str, Any]:
    params = vllm.SamplingParams(max_tokens=48, min_tokens=48, ignore_eos=True, logprobs=0, temperature=temperature)
    prompts = random_prompts(64, torch.Generator().manual_seed(seed))
    return generate_rollouts(engine, prompts, params, weight_sync=sync)


def test_raw_logprobs_sampled_at_another_temperature_are_named_for_what_was_sampled(engine: Any, hf_model: Any) -> None:
    vllm_rollouts._SAID.reset()
    sync = VLLMWeightSync(engine)
    with pytest.warns(integration.VLLMWarning):
        steps = [rollouts(engine, 0.7, seed, sync) for seed in range(2)]
    monitor = monitored(hf_model, steps)
    found = monitor.last_diagnosis
    assert found.cause == "sampling" and "drawn sharper" in found.message, found.message
    assert "the vllm engine reports raw_logprobs while sampling with temperature 0.7" in found.message
    assert monitor.last_metrics["optim/train-sample-div/sampling_z"] > 10
    honest = monitored(hf_model, [rollouts(engine, 1.0, seed, sync) for seed in range(2, 4)])
    assert honest.last_diagnosis.cause in ("none", "precision"), honest.last_diagnosis.message
    assert abs(honest.last_metrics["optim/train-sample-div/sampling_z"]) < 5
    vllm_rollouts._SAID.reset()


PROCESSED = """
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import vllm
from loops_callbacks.integrations.vllm import VLLMWeightSync, generate_rollouts, shutdown_engine
from tests.integrations.test_vllm import random_prompts
llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=256,
               seed=0, logprobs_mode="processed_logprobs")
params = vllm.SamplingParams(max_tokens=48, min_tokens=48, ignore_eos=True, logprobs=0, temperature=0.7)
sync = VLLMWeightSync(llm)
steps = [generate_rollouts(llm, random_prompts(64, torch.Generator().manual_seed(s)), params, weight_sync=sync)
         for s in range(2)]
torch.save(steps, sys.argv[2])
shutdown_engine(llm)
"""


def test_processed_logprobs_at_another_temperature_are_a_temperature_not_a_sampling_fault(
    tiny_llama_dir: Path, hf_model: Any, tmp_path: Path
) -> None:
    saved = tmp_path / "steps.pt"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", PROCESSED, str(tiny_llama_dir), str(saved)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = torch.load(saved, weights_only=False)
    assert steps[0]["sampler_facts"].logprobs_mode == "processed_logprobs"
    found = monitored(hf_model, steps).last_diagnosis
    assert found.cause == "temperature", found.message


def test_a_prefix_cache_kept_across_a_reload_is_named_from_the_engines_account(
    engine_back: Any, hf_model: Any, updated_model: Any
) -> None:
    sync = VLLMWeightSync(engine_back, reset_prefix_cache=False)  # the fault
    prefix = torch.randint(3, VOCAB, (2 * BLOCK,), generator=torch.Generator().manual_seed(5)).tolist()
    params = vllm.SamplingParams(max_tokens=16, min_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [prefix + p for p in random_prompts(32, torch.Generator().manual_seed(6))]
    generate_rollouts(engine_back, prompts, params, weight_sync=sync)  # the shared prefix is now in the cache
    sync.push(updated_model, version=1)
    steps = [generate_rollouts(engine_back, prompts, params, weight_sync=sync)]
    assert steps[0]["sampler_facts"].stale_prefix_cache
    found = monitored(updated_model, steps).last_diagnosis
    assert found.cause == "prefix_cache" and "llm.reset_prefix_cache()" in found.message, found.message
