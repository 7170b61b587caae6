"""``configs/rl_vllm.yaml`` runs through the command: a vLLM engine samples, is synced every step and is monitored.

One short run in a subprocess (its own engine, started by the demo; ~40 s with the imports): the
float32 engine's logprobs match the trainer's, the weight sync is logged every step, and every log
and the saved checkpoint of the Llama lie under the run's ``default_root_dir``.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.integrations.conftest import VLLM_ENVIRONMENT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_demo_trains_with_the_engine_synced_and_monitored(tmp_path: Path) -> None:
    root = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "loops_callbacks", "fit", "--config", str(ROOT / "configs" / "rl_vllm.yaml"),
         "--trainer.max_steps", "5", "--trainer.default_root_dir", str(root)],
        cwd=tmp_path, env={**os.environ, **VLLM_ENVIRONMENT, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Sampler-vs-trainer divergence (optim/train-sample-div/*): 1 logged steps" in done.stdout, done.stdout[-3000:]
    k3 = float(re.search(r"kl_sample_train_k3 +(\S+)", done.stdout).group(1))
    diff_max = float(re.search(r"diff_abs_max +(\S+)", done.stdout).group(1))
    assert 0 <= k3 < 1e-8 and diff_max < 1e-4, (k3, diff_max)  # a float32 engine: float32 rounding only
    assert (root / "vllm_model" / "config.json").is_file()
    (metrics,) = root.glob("csv/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    pushes = [float(row["train/weight_sync_ms"]) for row in rows if row.get("train/weight_sync_ms")]
    assert pushes and all(0 < ms < 30_000 for ms in pushes), pushes
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # nothing beside the run's directory


def test_the_servers_demo_trains_against_two_local_servers_synced_and_monitored(tmp_path: Path) -> None:
    """``configs/rl_vllm_servers.yaml``: two vLLM servers started by the demo (a minute or two to start here), each
    step's sync timed by phase, the rollouts of both servers monitored; the servers stopped when fit ends."""
    root = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "loops_callbacks", "fit", "--config", str(ROOT / "configs" / "rl_vllm_servers.yaml"),
         "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(root)],
        cwd=tmp_path, env={**os.environ, **VLLM_ENVIRONMENT, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    diff_max = float(re.search(r"diff_abs_max +(\S+)", done.stdout).group(1))
    assert diff_max < 1e-4, diff_max  # float32 servers: float32 rounding only
    (metrics,) = root.glob("csv/version_*/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("train/sync_transfer_ms")]
    assert len(rows) == 3 and all(float(row["train/servers"]) == 2 for row in rows)
    for phase in ("pause", "transfer", "cache", "version", "resume"):
        assert all(float(row[f"train/sync_{phase}_ms"]) > 0 for row in rows), phase
    logs = sorted(root.glob("servers/server*.log"))
    assert len(logs) == 2 and all("POST /update_weight_version" in log.read_text() for log in logs)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # nothing beside the run's directory
