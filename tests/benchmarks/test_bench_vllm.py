"""``benchmarks/bench_vllm.py`` still runs: a smoke run on tiny settings, whenever vLLM imports.

It checks that the script works and prints each of its figures' lines, not the figures (the
README's come from full runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.conftest import VLLM_ENVIRONMENT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_bench_vllm_runs_and_prints_the_cost_and_the_gap_lines(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--steps", "4", "--log-every-n-steps", "2",
         "--sequences", "8", "--repeats", "1", "--gaps", "--gap-steps", "2", "--variants", "no_reset"],
        cwd=tmp_path, env={**os.environ, **VLLM_ENVIRONMENT, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("CPU: ") and "vllm " in out.splitlines()[0], out[:300]
    for line in ("hook on logged steps (2)", "hook averaged over all steps", "weight sync (tiny Llama,",
                 "VLLMSamplingClient", "TorchSamplingClient", "largest |difference|",
                 "| 256-token system prompt, no reset (the fault) |"):
        assert line in out, (line, out[-3000:])
    assert list(tmp_path.iterdir()) == []  # it writes only in its temporary directory
