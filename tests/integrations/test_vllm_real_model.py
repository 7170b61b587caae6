"""What a vLLM engine says of its sampling, named from the first step on a real LLM (SmolLM2-135M-Instruct).

``benchmarks/real_model_faults.py``'s vLLM rows: an in-process ``vllm.LLM`` of SmolLM2 through the integration
(``VLLMWeightSync``, ``generate_rollouts``), which fills ``sampler_facts`` from the engine's settings and
``sampler_prompt_ids`` from ``RequestOutput.prompt_token_ids``. Run in a subprocess: its engine is not the
session's, and leaves nothing behind in this one. The checkpoint is built as ``tests/test_real_model.py``'s is
(``$LOOPS_CALLBACKS_CACHE``, else the session's tmp dir: about 30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("gguf", reason="the dev extra installs gguf: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"vllm_processed_T0.7": "temperature", "vllm_raw_T0.7": "sampling", "vllm_processed_top_p0.9": "truncation"}


def test_the_engines_temperature_and_top_p_are_named_from_the_first_step(tmp_path_factory: pytest.TempPathFactory
                                                                          ) -> None:
    """Processed logprobs at T 0.7 read temperature, raw ones sampling, processed at top-p 0.9 truncation: each at
    step 0, from the settings the engine reports (a fitted slope alone read 'unclear' on some steps)."""
    cache = os.environ.get("LOOPS_CALLBACKS_CACHE") or str(tmp_path_factory.mktemp("real_model"))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_model_faults.py"), "--steps", "1", "--cache-dir", cache,
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
