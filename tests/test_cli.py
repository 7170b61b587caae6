"""The ``loops-callbacks`` CLI runs every shipped config, round-trips them, and rejects bad values clearly."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch import LightningDataModule, LightningModule

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.cli import LoopsCLI, run_cli
from loops_callbacks.demo import CharTokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
K3 = "optim/train-sample-div/kl_sample_train_k3"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def in_a_scratch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs write under tmp_path: the configs use relative run directories."""
    monkeypatch.chdir(tmp_path)


def fit(config: str, *extra: str) -> LoopsCLI:
    return run_cli(["fit", "--config", str(CONFIGS / config), *extra])


def wandb_run_dir(root: str) -> str:
    runs = glob.glob(os.path.join(root, "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.parametrize("config", ["rl_tiny.yaml", "rl_stale_sampler.yaml"])
def test_rl_configs_run_and_leave_an_offline_wandb_run_with_the_table(config: str, capsys: Any) -> None:
    cli = fit(config, "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2")
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, KLSampleTrainMonitor))
    assert isinstance(monitor.media.tokenizer, CharTokenizer)
    assert K3 in monitor.last_metrics
    run = wandb_run_dir(f"runs/{config.removesuffix('.yaml')}")
    tables = glob.glob(os.path.join(run, "files", "media", "table", "**", "*.table.json"), recursive=True)
    assert len(tables) == 2  # steps 1 and 3
    out = capsys.readouterr().out
    assert "wandb sync" in out and "metrics.csv" in out and "kl_sample_train_k3" in out


def test_dpo_config_attaches_reference_logprobs_and_trains(capsys: Any) -> None:
    cli = fit("dpo_tiny.yaml", "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2")
    datamodule = cli.datamodule
    assert all("ref_logprobs" in d.loss_fn_inputs for d in datamodule.scored_data)
    assert "train/dpo_accuracy" in cli.trainer.callback_metrics
    wandb_run_dir("runs/dpo_tiny")
    assert glob.glob("runs/dpo_tiny/reference_logprobs/*")  # the cache a rerun loads


def test_stale_sampler_is_stopped_by_the_guard_rail(capsys: Any) -> None:
    cli = fit("rl_stale_sampler.yaml", "--trainer.max_steps", "150")
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, KLSampleTrainMonitor))
    assert monitor.stop_reason is not None and "exceeded max_kl = 0.05" in monitor.stop_reason
    assert cli.trainer.global_step < 150
    assert "Stopped by KLSampleTrainMonitor" in capsys.readouterr().out


def printed_config(config: Path, capsys: Any) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("config", ["rl_tiny.yaml", "rl_stale_sampler.yaml", "dpo_tiny.yaml"])
def test_print_config_round_trips(config: str, tmp_path: Path, capsys: Any) -> None:
    first = printed_config(CONFIGS / config, capsys)
    (tmp_path / "printed.yaml").write_text(first)
    second = printed_config(tmp_path / "printed.yaml", capsys)
    assert yaml.safe_load(second) == yaml.safe_load(first)
    assert yaml.safe_load(first)["trainer"]["max_steps"] in (150, 300)


def test_the_snippet_adds_the_monitor_to_any_experiment() -> None:
    parsed = LoopsCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        args=["--config", str(CONFIGS / "dpo_tiny.yaml"), "--trainer.logger", "false",
              f"--trainer.callbacks+={CONFIGS / 'callbacks' / 'kl_monitor.yaml'}"],
    )
    monitors = [c for c in parsed.trainer.callbacks if isinstance(c, KLSampleTrainMonitor)]
    assert len(monitors) == 1 and monitors[0].max_kl == 0.05 and monitors[0].on_exceed == "stop"


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.init_args.sync_every", "0"], "sync_every"),
        (["--model.init_args.group_size", "many"], "group_size"),
        (["--model.init_args.no_such_option", "1"], "no_such_option"),
        (["--data.init_args.batch_size", "-3"], "batch_size"),
    ],
)
def test_bad_config_values_fail_at_parse_time_naming_the_key(override: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        fit("rl_tiny.yaml", *override)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_console_script_exits_zero(tmp_path: Path) -> None:
    """`loops-callbacks` (as installed) and `python -m loops_callbacks` end with status 0."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "loops_callbacks", "fit", "--config", str(CONFIGS / "rl_tiny.yaml"),
         "--trainer.max_steps", "2", "--trainer.logger", "false"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
