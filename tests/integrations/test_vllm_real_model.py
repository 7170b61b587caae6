"""What a vLLM engine says of its sampling, named from the first step on a real LLM (SmolLM2-135M-Instruct).

``benchmarks/real_model_faults.py``'s vLLM rows: an in-process ``vllm.LLM`` of SmolLM2 through the integration
(``VLLMWeightSync``, ``generate_rollouts``), which fills ``sampler_facts`` from the engine's settings and
``sampler_prompt_ids`` from ``RequestOutput.prompt_token_ids``, run in a subprocess (its engine is not the
session's, and leaves nothing behind in this one); and a SmolLM2 vLLM server through ``VLLMServerFleet``. The checkpoint is built as ``tests/test_real_model.py``'s is
(``$LOOPS_CALLBACKS_CACHE``, else the session's tmp dir: about 30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("gguf", reason="the dev extra installs gguf: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from real_model import QUESTIONS, build, chat_prompts  # noqa: E402

EXPECTED = {"vllm_processed_T0.7": "temperature", "vllm_raw_T0.7": "sampling", "vllm_processed_top_p0.9": "truncation"}


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(os.environ.get("LOOPS_CALLBACKS_CACHE") or tmp_path_factory.mktemp("real_model"))


def test_the_engines_temperature_and_top_p_are_named_from_the_first_step(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Processed logprobs at T 0.7 read temperature, raw ones sampling, processed at top-p 0.9 truncation: each at
    step 0, from the settings the engine reports (a fitted slope alone read 'unclear' on some steps)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_model_faults.py"), "--steps", "1", "--cache-dir", str(smollm2_dir.parent),
         "--runs", ",".join(EXPECTED)],
        capture_output=True, text=True, env=env, cwd=tmp_path_factory.mktemp("vllm_real_model"), timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {cells[1].strip(): cells for line in done.stdout.splitlines()
            if (cells := line.split("|"))[0] == "" and len(cells) > 4 and cells[1].strip() in EXPECTED}
    assert set(rows) == set(EXPECTED), done.stdout
    for run, cause in EXPECTED.items():
        named, first = rows[run][2].strip(), rows[run][4].strip()
        assert named == f"{cause} 1" and first == "0", (run, done.stdout)


def test_a_servers_request_settings_are_named_from_the_first_step(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same over a vLLM server (``VLLMServerFleet.rollouts``, ``completions_batch``): a SmolLM2 server started
    with ``--logprobs-mode processed_logprobs``, asked for completions at temperature 0.7, read 'temperature' at
    step 0, from the request's settings, after the prompt ids it was sent were compared with the trainer's."""
    import torch
    import transformers
    from lightning.pytorch import LightningModule

    from loops_callbacks import KLSampleTrainMonitor, token_logprobs
    from loops_callbacks.integrations.vllm import LocalVLLMServers, VLLMServerFleet
    from tests.helpers import quiet_trainer
    from tests.integrations.conftest import VLLM_ENVIRONMENT

    model_dir = smollm2_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = chat_prompts(tokenizer, QUESTIONS[:2])

    class ServedPolicy(LightningModule):
        def __init__(self, fleet: VLLMServerFleet) -> None:
            super().__init__()
            self.policy, self.fleet = policy, fleet

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.arange(4), batch_size=None)

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            rollouts = self.fleet.rollouts(prompts, max_tokens=24, n=4, temperature=0.7, seed=0,
                                           stop_token_ids=[tokenizer.eos_token_id], pad_id=tokenizer.eos_token_id)
            fields = token_logprobs(self.policy(rollouts["input_ids"]).logits, rollouts["target_tokens"],
                                    with_entropy=True).outputs
            mask = rollouts["mask"]
            self.rollouts = rollouts
            return {**rollouts, **fields, "loss": -(fields["training_logprobs"] * mask).sum() / mask.sum()}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.policy.parameters(), lr=0.0)

    with LocalVLLMServers(model_dir, count=1, workdir=tmp_path_factory.mktemp("served"), environment=VLLM_ENVIRONMENT,
                          extra_args=["--logprobs-mode", "processed_logprobs"], start_timeout=400) as servers:
        fleet = VLLMServerFleet(servers.urls, weights_dir=tmp_path_factory.mktemp("weights"))
        monitor = KLSampleTrainMonitor(log_every_n_steps=1, tokenizer=tokenizer)
        module = ServedPolicy(fleet)
        quiet_trainer(max_steps=1, callbacks=[monitor]).fit(module)
    found = monitor.last_diagnosis
    assert found.cause == "temperature" and found.is_observation, found.message
    assert "divide the trainer's logits by 0.7" in found.message, found.message
    sent = [[i for i in row if i >= 0] for row in module.rollouts["sampler_prompt_ids"].tolist()]
    assert sent == [prompt for prompt in prompts for _ in range(4)]  # compared with the trainer's: the same ids
