"""The ``loops-callbacks`` command as a user runs it: exit statuses a script can act on, the summary as the
last thing printed (after W&B's shutdown output), every log under ``--trainer.default_root_dir``, one-line
errors and a ``--help`` that lists the shipped configs.

What only a process of its own shows runs through the console script, once each: the terminal's order of
W&B's output and the summary (one guard-rail stop, checked for everything it shows), two runs at once,
Ctrl-C, a killed DDP rank. Those runs start ahead of their tests, two at a time (``command_runs``);
the rest runs ``main`` in this process meanwhile.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import yaml

from loops_callbacks.cli import main, run_cli, shipped_configs
from loops_callbacks.cli.refusals import missing_package
from loops_callbacks.cli.summary import (
    EXIT_ERROR,
    EXIT_GUARD_RAIL_RAISED,
    EXIT_GUARD_RAIL_STOPPED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RANK_KILLED,
    EXIT_STATUSES,
    EXIT_USAGE,
)
from tests.cli.test_cli import K3, P, tensorboard_events, text_at
from tests.helpers import in_background, selected_in_this_module

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TIMEOUT_S = 300

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def console_script() -> str:
    found = shutil.which("loops-callbacks", path=str(Path(sys.executable).parent)) or shutil.which("loops-callbacks")
    assert found, "the loops-callbacks console script is not installed (pip install -e .)"
    return found


def run_command(*args: str, cwd: Path, extra_env: dict[str, str] | None = None) -> tuple[int, str]:
    """``loops-callbacks *args`` in ``cwd``: (exit status, stdout and stderr interleaved as a terminal shows them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "false", **(extra_env or {})}
    done = subprocess.run(
        [console_script(), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=TIMEOUT_S,
    )
    return done.returncode, done.stdout


def exit_of(*args: str) -> int:
    """``main(args)`` in this process: its exit status."""
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    return exit_.value.code


def last_lines(output: str, count: int) -> list[str]:
    return [line for line in output.splitlines() if line.strip()][-count:]


def summary_block(output: str) -> list[str]:
    """The lines from the summary's "Logs:" header to the end."""
    lines = output.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "Logs:")
    return lines[start:]


def files_under(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file())


def guard_rail_stop(folder: Path) -> tuple[int, str]:
    """The stale-sampler config run in ``folder/here``, its logs under ``folder/elsewhere/run``."""
    here, root = folder / "here", folder / "elsewhere" / "run"
    here.mkdir()
    return run_command(
        "fit", "--config", str(CONFIGS / "rl_stale_sampler.yaml"), "--trainer.default_root_dir", str(root), cwd=here
    )


def test_a_guard_rail_stop_exits_3_with_the_summary_last_and_every_log_under_the_root_dir(
    command_runs: dict[str, Future[Any]]
) -> None:
    folder, (status, output) = command_runs["guard_rail_stop"].result()
    here, root = folder / "here", folder / "elsewhere" / "run"
    assert status == EXIT_GUARD_RAIL_STOPPED, output[-3000:]
    # the summary comes after W&B's shutdown output, the guard rail's verdict last
    assert "wandb: Find logs at" in output, output[-3000:]
    summary = summary_block(output)
    assert output.rindex("wandb:") < output.rindex("\nLogs:\n")
    assert not any(line.startswith("wandb:") for line in summary), summary
    (stop_step,) = map(int, re.findall(r"exceeded max_kl = 0\.05 at step (\d+)", last_lines(output, 1)[0]))
    assert stop_step < 300  # before max_steps
    assert any(f"tensorboard --logdir {root}/tensorboard/version_0" in line for line in summary), summary
    assert any(line.strip().startswith("kl_sample_train_k3") for line in summary), summary
    # no advertisement
    assert "litlogger" not in output
    # every log under the given root, nothing where the command ran
    assert files_under(here) == []
    written = {path.relative_to(root).parts[0] for path in files_under(root)}
    assert {"csv", "tensorboard", "wandb"} <= written, written
    # the saved config is the one given: rerun, it writes where it says again (not under root/root)
    saved = yaml.safe_load((root / "csv" / "version_0" / "config.yaml").read_text())["trainer"]
    assert saved["default_root_dir"] == str(root) and {lg["init_args"]["save_dir"] for lg in saved["logger"]} == {"."}
    # the monitor judged every step (its own log_every_n_steps: 1, the trainer's 5), and the stop is in the
    # TensorBoard run as text at the step it fired
    events = tensorboard_events(str(root / "tensorboard" / "version_0"))
    monitored = [event.step for event in events.Scalars(K3)]
    assert monitored == list(range(stop_step + 1)), monitored
    assert [event.step for event in events.Histograms(P + "per_token_diff_hist")] == monitored
    texts = text_at(events, P + "guard_rail/text_summary")
    assert list(texts) == [stop_step] and "exceeded max_kl = 0.05" in texts[stop_step]
    # and W&B has each judged step's worst-tokens and strata tables
    (run,) = glob.glob(str(root / "wandb" / "offline-run-*"))
    tables = [os.path.basename(t) for t in glob.glob(os.path.join(run, "files", "media", "table", "**", "*.table.json"),
                                                     recursive=True)]
    assert sorted(t.split("_")[0] for t in tables) == ["strata"] * len(monitored) + ["worst"] * len(monitored), tables


def test_a_guard_rail_raise_exits_4_with_its_message_last_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    status = exit_of("fit", "--config", str(CONFIGS / "rl_stale_sampler.yaml"),
                     "--trainer.callbacks.init_args.guard_rail.on_exceed", "raise", "--trainer.logger", "false",
                     "--trainer.default_root_dir", str(tmp_path))
    out, err = capsys.readouterr()
    assert status == EXIT_GUARD_RAIL_RAISED, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err
    assert re.search(r"exceeded max_kl = 0\.05 at step \d+", last_lines(out, 1)[0]), last_lines(out, 3)


def test_a_dpo_run_exits_0_with_its_summary_and_a_rerun_loads_the_reference_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    config = ("fit", "--config", str(CONFIGS / "dpo_tiny.yaml"))
    status = exit_of(*config, "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2",
                     "--trainer.val_check_interval", "4")
    summary = summary_block(capsys.readouterr().out)
    assert status == EXIT_OK, summary
    assert "  TensorBoard:  tensorboard --logdir runs/dpo_tiny/tensorboard/version_0" in summary, summary
    assert list((tmp_path / "runs/dpo_tiny/tensorboard/version_0").glob("events.out.tfevents.*")), summary
    assert len(list((tmp_path / "runs/dpo_tiny/wandb").glob("offline-run-*"))) == 1
    (reference,) = [line for line in summary if line.startswith("Reference logprobs:")]
    assert "2048 datums scored" in reference and "runs/dpo_tiny/reference_logprobs" in reference, reference
    assert list((tmp_path / "runs/dpo_tiny/reference_logprobs").iterdir())  # the cache a rerun loads
    metrics = {line.split()[0] for line in summary if line.startswith("  ") and "/" in line.split()[0]}
    assert {"train/dpo_loss", "train/dpo_accuracy", "val/dpo_loss", "val/dpo_accuracy"} <= metrics, summary
    assert exit_of(*config, "--trainer.max_steps", "1", "--trainer.logger", "false") == EXIT_OK
    (reference,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Reference logprobs:")]
    assert "loaded from the cache runs/dpo_tiny/reference_logprobs" in reference and "nothing scored" in reference


def two_runs_at_once(folder: Path) -> list[tuple[int, str, str]]:
    """Two 1-step runs of rl_tiny in ``folder``, started together: each one's (status, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    arguments = ["fit", "--config", str(CONFIGS / "rl_tiny.yaml"), "--trainer.max_steps", "1",
                 "--trainer.enable_progress_bar", "false", "--model.init_args.lr"]
    runs = [
        subprocess.Popen([*command, *arguments, lr], cwd=folder, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for command, lr in (([console_script()], "0.001"), ([sys.executable, "-m", "loops_callbacks"], "0.002"))
    ]
    outputs = [run.communicate(timeout=TIMEOUT_S) for run in runs]
    return [(run.returncode, output, errors) for run, (output, errors) in zip(runs, outputs)]


def test_two_runs_started_at_once_in_one_root_dir_keep_their_own_config_and_exit_0(
    command_runs: dict[str, Future[Any]]
) -> None:
    """Each run's config.yaml goes in its own log version (a W&B-first run's Lightning log_dir is shared); one
    is started as ``loops-callbacks``, the other as ``python -m loops_callbacks``."""
    folder, runs = command_runs["two_runs_at_once"].result()
    for status, output, errors in runs:
        assert status == EXIT_OK, errors[-3000:]
        assert "no exceedance" in last_lines(output, 1)[0], output[-2000:]
    root = folder / "runs" / "rl_tiny"
    saved = sorted(root.rglob("config.yaml"))
    assert [path.relative_to(root).parent.as_posix() for path in saved] == ["csv/version_0", "csv/version_1"], saved
    assert sorted(yaml.safe_load(path.read_text())["model"]["init_args"]["lr"] for path in saved) == [0.001, 0.002]


def test_a_spawning_strategy_with_a_monitor_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ddp_spawn trains in child processes: the command would report "no exceedance" and exit 0 after a stop."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_cli(["fit", "--config", str(CONFIGS / "rl_stale_sampler.yaml"), "--trainer.devices", "2",
                 "--trainer.strategy", "ddp_spawn", "--trainer.logger", "false"])
    assert exit_.value.code == EXIT_USAGE
    assert "Use --trainer.strategy ddp" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_the_hf_config_run_outside_the_checkout_names_the_tokenizer_key_and_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """configs/dpo_hf.yaml's paths are relative to the checkout: elsewhere they are not found, and the error says so."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    assert exit_of("fit", "--config", str(CONFIGS / "dpo_hf.yaml")) == EXIT_USAGE
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith(
        "loops-callbacks: error: model: HFDPOModule model['tokenizer'] 'configs/data/chat_tokenizer' does not exist "
        f"(a relative path is taken from the working directory, {tmp_path})"
    ), error


def test_a_value_where_a_group_of_options_goes_exits_2_in_one_line_from_the_console_script(tmp_path: Path) -> None:
    """``guard_rail: 0.05`` exited 1 with jsonargparse's traceback ("argument after ** must be a mapping, not float");
    tests/cli/test_cli.py has every shape of it in this process."""
    (tmp_path / "monitor.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: KLSampleTrainMonitor\n      init_args:\n        guard_rail: 0.05\n")
    runs = [("--config", "monitor.yaml"), ("--trainer.callbacks.init_args.guard_rail=[0.05]",)]
    for given, value in zip(runs, ("0.05", "[0.05]")):
        status, output = run_command("fit", "--config", str(CONFIGS / "rl_tiny.yaml"), *given, cwd=tmp_path)
        assert status == EXIT_USAGE, output[-3000:]
        (line,) = output.splitlines()
        assert line.startswith("loops-callbacks: error: trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a "
                               "group of options, GuardRail's (max_kl, ") and line.endswith(f"; got {value}"), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["monitor.yaml"]  # nothing ran


def test_a_missing_extra_is_one_line_the_last_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import_module = importlib.import_module

    def without_hf_extra(name: str, package: str | None = None) -> Any:
        """The package reaches the hf extra through importlib.import_module: fail as if it were not installed."""
        if name.split(".")[0] in ("transformers", "datasets"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return import_module(name, package)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(importlib, "import_module", without_hf_extra)
    assert exit_of("fit", "--config", str(CONFIGS / "dpo_hf.yaml")) == EXIT_ERROR
    out, err = capsys.readouterr()
    (last,) = last_lines(err, 1)
    assert last.startswith("loops-callbacks: error: ") and "'hf' extra" in last and 'pip install -e ".[hf]"' in last
    output = out + err
    assert "Traceback" not in output and "Namespace(" not in output and "Union" not in output, output[-3000:]


def test_help_says_what_the_tool_is_and_lists_the_configs_the_main_commands_and_the_exit_statuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert exit_of("--help") == 0
    output = capsys.readouterr().out
    assert "Lightning Trainer command line tool" not in output
    assert "KLSampleTrainMonitor" in output and "reference logprobs" in output
    assert "loops-callbacks fit --config configs/rl_tiny.yaml" in output
    assert "loops-callbacks fit --config configs/dpo_tiny.yaml" in output
    assert str(CONFIGS) in output  # where the configs are (outside the working directory: absolute)
    configs = shipped_configs()
    assert set(configs) == {p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.yaml")}
    for name, description in configs.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(description)}$", output, re.MULTILINE), name
    for status_, meaning in EXIT_STATUSES.items():
        assert f"  {status_}  {meaning}" in output


@pytest.mark.parametrize("path", sorted(p.relative_to(CONFIGS).as_posix() for p in CONFIGS.rglob("*.yaml")))
def test_each_config_opens_with_a_one_line_description(path: str) -> None:
    first, second = (CONFIGS / path).read_text().splitlines()[:2]
    assert first.startswith("# ") and len(first) <= 110 and first.endswith(".") and second == "#", first


@pytest.mark.parametrize("path", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_logger_writes_under_default_root_dir(path: str) -> None:
    trainer = yaml.safe_load((CONFIGS / path).read_text())["trainer"]
    assert trainer["default_root_dir"] == f"runs/{path.removesuffix('.yaml')}"
    kinds = set()
    for logger in trainer["logger"]:
        assert logger["init_args"]["save_dir"] == ".", logger  # relative: under default_root_dir
        kinds.add(logger["class_path"].rsplit(".", 1)[1])
    assert "TensorBoardLogger" in kinds and "CSVLogger" in kinds


def test_only_an_import_error_that_caused_the_failure_is_reported_as_a_missing_package() -> None:
    try:
        try:
            raise ImportError("optional speed-up not installed")
        except ImportError:
            raise ValueError("batch_size must be positive") from None  # handled, not the cause
    except ValueError as unrelated:
        assert missing_package(unrelated) is None
    try:
        try:
            raise ImportError("needs the 'transformers' package")
        except ImportError as error:
            raise ValueError("Does not validate against any of the Union subtypes") from error
    except ValueError as wrapped:
        assert str(missing_package(wrapped)) == "needs the 'transformers' package"


def test_a_shipped_rl_run_resumes_through_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """LightningCLI reads a checkpoint with ``weights_only=True``: nothing in a shipped config's
    checkpoint may be a jsonargparse type (the optimizer's ``lr`` was a ``PositiveFloat``)."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    common = ("fit", "--config", str(CONFIGS / "rl_tiny.yaml"), "--trainer.default_root_dir", str(root),
              "--trainer.logger", "false", "--trainer.enable_checkpointing", "true")
    assert exit_of(*common, "--trainer.max_steps", "10") == EXIT_OK
    (checkpoint,) = root.rglob("*.ckpt")
    lightning_log = logging.getLogger("lightning.pytorch")  # it does not propagate to the root logger
    lightning_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            assert exit_of(*common, "--trainer.max_steps", "20", "--ckpt_path", str(checkpoint)) == EXIT_OK
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert "Restored all states from the checkpoint" in caplog.text
    assert last_lines(capsys.readouterr().out, 1)[0].startswith("Guard rail: no exceedance")


def ctrl_c(folder: Path) -> tuple[int, str]:
    """A long run of rl_tiny in ``folder``, sent SIGINT 2 s into its steps: its status and output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [console_script(), "fit", "--config", str(CONFIGS / "rl_tiny.yaml"), "--trainer.logger", "false",
         "--trainer.default_root_dir", str(folder / "run"), "--trainer.enable_progress_bar", "false",
         "--trainer.max_steps", "5000"],  # minutes of training: a loaded machine cannot finish it before the signal
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # a Ctrl-C reaches the command as in a terminal, even where this test runs with SIGINT ignored (a background
        # job, a CI runner): a child inherits an ignored SIGINT, and Python then raises no KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert process.stdout is not None
        seen = []
        for line in process.stdout:  # the model summary comes just before the first step
            seen.append(line)
            if "Total params" in line or len(seen) > 2000:
                break
        time.sleep(2.0)  # into the steps
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        process.kill()
    return process.returncode, "".join(seen) + rest


def test_ctrl_c_prints_the_summary_so_far_and_exits_130(command_runs: dict[str, Future[Any]]) -> None:
    _, (status, output) = command_runs["ctrl_c"].result()
    assert status == EXIT_INTERRUPTED, output[-3000:]
    assert re.fullmatch(r"Interrupted \(Ctrl-C\) at step \d+: the run did not finish", last_lines(output, 1)[0])
    assert "Sampler-vs-trainer divergence" in output


KILL_RANK_1 = """
import os
import signal

from lightning.pytorch import Callback


class KillRank1(Callback):
    \"\"\"SIGKILLs rank 1 as step 3 starts, as the out-of-memory killer would.\"\"\"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
"""


KILL_RANK_1_WHILE_SCORING = """
import os
import signal

from loops_callbacks.demo import ReversePairsDataModule


class KillRank1WhileScoring(ReversePairsDataModule):
    \"\"\"SIGKILLs rank 1 as the reference scoring starts: rank 0 waits for it in the store, not in gloo.\"\"\"

    def setup(self, stage):
        if self.trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        super().setup(stage)
"""


def run_two_ranks_with(tmp_path: Path, killer: str, config: str, *args: str) -> tuple[int, str]:
    """The command's status and output for a 2-rank DDP run of ``config`` with ``killer`` importable as ``killer``."""
    (tmp_path / "killer.py").write_text(killer)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    process = subprocess.Popen(
        [console_script(), "fit", "--config", str(CONFIGS / config), "--trainer.devices", "2",
         "--trainer.strategy", "ddp", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # rank 1 and anything left of the run, whatever happened
    return process.returncode, output


def killed_while_scoring(folder: Path) -> tuple[int, str]:
    return run_two_ranks_with(folder, KILL_RANK_1_WHILE_SCORING, "dpo_tiny.yaml", "--data", "killer.KillRank1WhileScoring")


def killed_while_training(folder: Path) -> tuple[int, str]:
    return run_two_ranks_with(folder, KILL_RANK_1, "rl_tiny.yaml", "--trainer.callbacks+=killer.KillRank1")


RUNS = {  # the console-script runs and the test that reads each
    "guard_rail_stop": "test_a_guard_rail_stop_exits_3_with_the_summary_last_and_every_log_under_the_root_dir",
    "two_runs_at_once": "test_two_runs_started_at_once_in_one_root_dir_keep_their_own_config_and_exit_0",
    "ctrl_c": "test_ctrl_c_prints_the_summary_so_far_and_exits_130",
    "killed_while_scoring": "test_a_ddp_rank_killed_during_reference_scoring_exits_137_after_the_summary_so_far",
    "killed_while_training": "test_a_ddp_rank_killed_during_training_exits_137_after_the_summary_so_far",
}


@pytest.fixture(scope="module")
def command_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Any]]]:
    """The console-script runs of the selected tests, ``{run: future of (its folder, what it returned)}``.

    Each run is a process of its own that keeps about one core busy while pytest waits: they start
    with the first test that reads one, two at a time, and go on through the tests that run ``main``
    in this process, so that both cores work.
    """

    def start(run: str) -> Callable[[], tuple[Path, Any]]:
        folder = tmp_path_factory.mktemp(run)
        return lambda: (folder, globals()[run](folder))

    selected = {item.originalname for item in selected_in_this_module(request)}
    with in_background({run: start(run) for run, test in RUNS.items() if test in selected}) as runs:
        yield runs


def test_a_ddp_rank_killed_during_reference_scoring_exits_137_after_the_summary_so_far(
    command_runs: dict[str, Future[Any]]
) -> None:
    """Lightning's watcher of the ranks SIGKILLed rank 0 there: exit 137 and not a word of what happened."""
    _, (status, output) = command_runs["killed_while_scoring"].result()
    assert status == EXIT_RANK_KILLED, output[-3000:]
    assert last_lines(output, 1) == ["Rank 1 was killed by SIGKILL at step 0: the run did not finish"], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_ddp_rank_killed_during_training_exits_137_after_the_summary_so_far(
    command_runs: dict[str, Future[Any]]
) -> None:
    """Rank 0 sees gloo's "Connection closed by peer": it was a traceback and exit 1, as if rank 0 had failed."""
    _, (status, output) = command_runs["killed_while_training"].result()
    assert status == EXIT_RANK_KILLED == 137, output[-3000:]
    assert last_lines(output, 1) == ["Rank 1 was killed by SIGKILL at step 3: the run did not finish"], output[-3000:]
    assert last_lines(output, 2)[0].startswith("Guard rail: "), output[-3000:]  # the monitor's summary, before it
    assert "Traceback" not in output, output[-3000:]

