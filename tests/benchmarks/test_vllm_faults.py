"""``benchmarks/vllm_faults.py`` runs on a real vLLM engine, and replaying its kept batches names the same causes.

A smoke run on tiny settings, whenever vLLM imports: the two shared-prefix loops (one engine, the
prefix cache reset after each push or not), two healthy and two fault steps each. It checks that the
script works and prints its tables, not the figures (they come from full runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.integrations.conftest import VLLM_ENVIRONMENT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_faults  # noqa: E402


def test_the_shared_prefix_loops_run_on_vllm_and_their_replay_names_the_same_causes(tmp_path: Path) -> None:
    work, kept, steps_file = tmp_path / "work", tmp_path / "kept", tmp_path / "steps.json"
    work.mkdir()
    environment = {**os.environ, **VLLM_ENVIRONMENT, "OMP_NUM_THREADS": "1",
                   "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache"), "VLLM_CONFIG_ROOT": str(tmp_path / "vllm_config")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_faults.py"), "--only", "shared prefix", "--healthy-steps", "2",
         "--steps", "2", "--prompts", "8", "--group", "2", "--completion", "8", "--show", "--save-dir", str(kept),
         "--json", str(steps_file)],
        cwd=work, env=environment, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("# vLLM faults, 2 healthy + 2 fault steps per setting, sampled by vLLM; "), out[:300]
    assert "| true cause |" in out and "\n| healthy |" in out, out
    rows = [line.split(" | ")[:3] for line in out.splitlines() if line.startswith("| 256-token shared prefix")]
    assert rows == [["| 256-token shared prefix, cache reset", "healthy", "4/4"],
                    ["| 256-token shared prefix, cache not reset", "prefix_cache", "4/4"]], out
    assert "256-token shared prefix, cache not reset:\n    step 0 " in out  # --show: each named cause's first step
    assert list(work.iterdir()) == []  # it writes only in its temporary directory and where it is told

    for loop in json.loads(steps_file.read_text()):
        setting = vllm_faults.Setting(**loop["setting"])
        saved = torch.load(kept / vllm_faults.kept_file_name(setting))
        replayed = vllm_faults.replay(saved["steps"])
        assert [(s.step, s.cause, s.k3) for s in replayed] == [(s["step"], s["cause"], s["k3"]) for s in loop["steps"]]
