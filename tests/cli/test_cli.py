"""The ``loops-callbacks`` CLI runs every shipped config, round-trips them, and rejects bad values clearly."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from loops_callbacks import KLSampleTrainMonitor
from loops_callbacks.cli import LoopsCLI, run_cli, run_summary
from loops_callbacks.demo import CharTokenizer
from loops_callbacks.divergence.report import deliver_text

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
P = "optim/train-sample-div/"
K3 = P + "kl_sample_train_k3"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def in_a_scratch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs write under tmp_path: the configs use relative run directories."""
    monkeypatch.chdir(tmp_path)


def fit(config: str, *extra: str) -> LoopsCLI:
    return run_cli(["fit", "--config", str(CONFIGS / config), *extra])


@contextlib.contextmanager
def seed_messages() -> Iterator[list[str]]:
    """What Lightning's seed logger says meanwhile ("Seed set to 0"); its handler writes to the stderr it found at
    import, which capsys does not see."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.fabric.utilities.seed")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def wandb_run_dir(root: str) -> str:
    runs = glob.glob(os.path.join(root, "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def tensorboard_command(out: str) -> str:
    """The log dir of the one `tensorboard --logdir ...` command the summary printed."""
    commands = re.findall(r"tensorboard --logdir (\S+)", out)
    assert len(commands) == 1, out
    return commands[0]


def tensorboard_events(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}).Reload()


def text_at(events: Any, tag: str) -> dict[int, str]:
    return {event.step: event.tensor_proto.string_val[0].decode() for event in events.Tensors(tag)}


def test_the_rl_config_runs_and_leaves_an_offline_wandb_run_with_the_tables(capsys: Any) -> None:
    """The monitor logs with the trainer (every 2 steps here; rl_stale_sampler's judges every step: test_exit_statuses)."""
    config, monitored = "rl_tiny.yaml", [1, 3]
    with seed_messages() as said:
        cli = fit(config, "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2")
    assert said == ["Seed set to 0"]  # once the classes are made
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, KLSampleTrainMonitor))
    assert isinstance(monitor.tokenizer, CharTokenizer)
    assert K3 in monitor.last_metrics
    run = wandb_run_dir(f"runs/{config.removesuffix('.yaml')}")
    tables = glob.glob(os.path.join(run, "files", "media", "table", "**", "*.table.json"), recursive=True)
    # each monitored step: the worst-tokens table, and the strata table beside it
    assert len([t for t in tables if os.path.basename(t).startswith("worst_tokens_")]) == len(monitored), tables
    assert len([t for t in tables if os.path.basename(t).startswith("strata_")]) == len(monitored), tables
    assert len(tables) == 2 * len(monitored), tables
    out = capsys.readouterr().out
    assert "wandb sync" in out and "metrics.csv" in out and "kl_sample_train_k3" in out
    log_dir = tensorboard_command(out)
    assert log_dir == f"runs/{config.removesuffix('.yaml')}/tensorboard/version_0"
    # what that command shows: the scalars over steps, the diff histogram and the worst-tokens table
    events = tensorboard_events(log_dir)
    assert [event.step for event in events.Scalars(K3)] == monitored
    assert [event.step for event in events.Scalars("train/reward")] == [1, 3]
    assert [event.step for event in events.Histograms(P + "per_token_diff_hist")] == monitored
    tables = text_at(events, P + "worst_tokens/text_summary")
    assert sorted(tables) == monitored
    header, _, *rows = tables[3].splitlines()
    assert header.split(" | ")[3] == "token" and len(rows) == 20
    texts = {f"`{CharTokenizer().decode([i])}`" for i in range(CharTokenizer().vocab_size)} | {"`<end>`"}
    assert {row.split(" | ")[3] for row in rows} <= texts  # the tokenizer's text of each token


class DPORun(NamedTuple):
    cli: LoopsCLI
    warnings: list[str]  # every warning the run gave
    scratch: Path  # where it ran


@pytest.fixture(scope="module")
def dpo_run_without_held_out_pairs(tmp_path_factory: pytest.TempPathFactory) -> DPORun:
    """One run of dpo_tiny without held-out pairs, in a scratch dir, checked by the two tests below."""
    scratch, threads = tmp_path_factory.mktemp("dpo_run"), torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        patch.chdir(scratch)
        torch.set_num_threads(1)  # as one_torch_thread (function-scoped)
        warnings.simplefilter("always")
        try:
            cli = fit("dpo_tiny.yaml", "--data.init_args.val_fraction", "0", "--trainer.logger", "false",
                      "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1")
        finally:
            torch.set_num_threads(threads)
    return DPORun(cli, [str(w.message) for w in caught], scratch)


def test_dpo_without_held_out_pairs_runs_no_validation_and_warns_nothing(dpo_run_without_held_out_pairs: DPORun) -> None:
    cli, caught, _ = dpo_run_without_held_out_pairs
    under_pytest = "LightningCLI's args parameter"  # sys.argv holds pytest's arguments
    assert [message for message in caught if not message.startswith(under_pytest)] == []
    assert cli.trainer.global_step == 2 and cli.trainer.limit_val_batches == 0


def test_dpo_config_attaches_reference_logprobs_and_trains(dpo_run_without_held_out_pairs: DPORun) -> None:
    """Every datum of the DataModule carries its reference logprobs after the run, and they are cached."""
    cli, _, scratch = dpo_run_without_held_out_pairs
    datums = cli.datamodule.scored_pairs.datums()
    assert len(datums) == 2048 and all("ref_logprobs" in d.loss_fn_inputs for d in datums)
    assert "train/dpo_accuracy" in cli.trainer.callback_metrics
    assert list((scratch / "runs/dpo_tiny/reference_logprobs").iterdir())  # the cache a rerun loads


def printed_config(config: Path, capsys: Any) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("config", ["rl_tiny.yaml", "rl_stale_sampler.yaml", "rl_unmonitored.yaml", "dpo_tiny.yaml"])
def test_print_config_round_trips(config: str, tmp_path: Path, capsys: Any) -> None:
    first = printed_config(CONFIGS / config, capsys)
    (tmp_path / "printed.yaml").write_text(first)
    second = printed_config(tmp_path / "printed.yaml", capsys)
    assert yaml.safe_load(second) == yaml.safe_load(first)
    assert yaml.safe_load(first)["trainer"]["max_steps"] == yaml.safe_load((CONFIGS / config).read_text())["trainer"]["max_steps"]


SNIPPET = "--trainer.callbacks+=configs/callbacks/kl_monitor.yaml"


@pytest.fixture
def configs_here(tmp_path: Path) -> None:
    """The shipped configs under ./configs, so the README's relative command lines run as written."""
    shutil.copytree(CONFIGS, tmp_path / "configs")


def test_the_unmonitored_rl_experiment_is_rl_tiny_without_its_monitor() -> None:
    tiny = yaml.safe_load((CONFIGS / "rl_tiny.yaml").read_text().replace("rl_tiny", "rl_unmonitored"))
    del tiny["trainer"]["callbacks"]
    assert yaml.safe_load((CONFIGS / "rl_unmonitored.yaml").read_text()) == tiny


def test_the_unmonitored_rl_experiment_has_no_monitor() -> None:
    parsed = LoopsCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                      run=False, args=["--config", str(CONFIGS / "rl_unmonitored.yaml"), "--trainer.logger", "false"])
    assert not any(isinstance(c, KLSampleTrainMonitor) for c in parsed.trainer.callbacks)


@pytest.mark.usefixtures("configs_here")
def test_the_snippet_does_not_fit_the_other_shipped_experiments() -> None:
    """As the snippet's comment says: rl_tiny already has a monitor; dpo_tiny has no sampler logprobs."""
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `KLSampleTrainMonitor`"):
        run_cli(["fit", "--config", "configs/rl_tiny.yaml", SNIPPET, "--trainer.logger", "false"])
    with pytest.raises(ValueError, match="'logprobs', 'mask'"):
        run_cli(["fit", "--config", "configs/dpo_tiny.yaml", SNIPPET, "--trainer.logger", "false",
                 "--trainer.max_steps", "1"])


@pytest.mark.usefixtures("configs_here")
def test_the_snippet_command_monitors_the_unmonitored_rl_experiment_and_wandb_writes_in_its_run_directory(
    tmp_path: Path, capsys: Any
) -> None:
    """W&B's service resolves a relative dir against its own working directory, not the run's:
    the CLI hands W&B the config's directory made absolute, so nothing lands where the service started."""
    import wandb

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    wandb.init(dir=str(elsewhere), project="loops-callbacks-tests").finish()  # the service runs from here on
    os.chdir(tmp_path)
    cli = run_cli(["fit", "--config", "configs/rl_unmonitored.yaml", SNIPPET,  # the command line of the README
                   "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1"])
    monitors = [c for c in cli.trainer.callbacks if isinstance(c, KLSampleTrainMonitor)]
    assert len(monitors) == 1 and monitors[0].guard_rail.max_kl == 0.05 and monitors[0].guard_rail.on_exceed == "stop"
    assert K3 in monitors[0].last_metrics
    assert "kl_sample_train_k3" in capsys.readouterr().out
    (logger,) = [logger for logger in cli.trainer.loggers if isinstance(logger, WandbLogger)]
    assert logger.experiment.settings.root_dir == str(tmp_path / "runs" / "rl_unmonitored")
    wandb_run_dir(str(tmp_path / "runs" / "rl_unmonitored"))
    assert not (elsewhere / "runs").exists()  # (where its output.log went before)


class SummarizedMonitor(KLSampleTrainMonitor):
    def summary_lines(self) -> list[str]:
        return ["Sampler-vs-trainer divergence: 3 logged steps", "Guard rail: the verdict"]


def test_summary_without_loggers_and_without_minus_zero_ends_with_the_monitor_summary() -> None:
    monitor = SummarizedMonitor()
    trainer = Trainer(logger=False, callbacks=[monitor], enable_progress_bar=False)
    trainer.callback_metrics.update({"train/loss": torch.tensor(-0.0), "train/reward": torch.tensor(-1.5e-05),
                                     P + "kl_sample_train_k3": torch.tensor(2.0)})
    summary = run_summary(trainer)
    assert "Logs:" not in summary
    assert re.search(r"train/loss\s+0$", summary, re.MULTILINE), summary
    assert not re.search(r"(?<![\w.])-0(?![\w.])", summary), summary
    assert re.search(r"train/reward\s+-1.5e-05$", summary, re.MULTILINE)
    assert "kl_sample_train_k3" not in summary  # the monitor's own numbers are in its summary
    assert summary.splitlines()[-2:] == monitor.summary_lines()  # its verdict last


def test_deliver_text_reaches_tensorboard_and_wandb_and_skips_the_rest(tmp_path: Path) -> None:
    tensorboard = TensorBoardLogger(str(tmp_path), name="tb")
    wandb_logger = WandbLogger(save_dir=str(tmp_path), project="loops-callbacks-tests", offline=True)
    message = "kl_sample_train_k3 = 0.12 exceeded max_kl = 0.05 at step 9 <stop>"
    try:
        deliver_text([object(), tensorboard, wandb_logger], P + "guard_rail", message, step=9)
        run_dir = wandb_logger.experiment.dir
    finally:
        wandb_logger.experiment.finish()
    tensorboard.experiment.flush()
    assert text_at(tensorboard_events(tensorboard.log_dir), P + "guard_rail/text_summary") == {9: message}
    (page,) = glob.glob(os.path.join(run_dir, "media", "html", "**", "*.html"), recursive=True)
    assert "exceeded max_kl = 0.05 at step 9 &lt;stop&gt;" in Path(page).read_text()


def test_a_logger_that_cannot_take_text_is_a_warning(tmp_path: Path) -> None:
    class FullDisk(TensorBoardLogger):
        @property
        def experiment(self) -> Any:
            raise OSError("No space left on device")

    with pytest.warns(UserWarning, match="could not log 'stop' to FullDisk at step 3: OSError"):
        deliver_text([FullDisk(str(tmp_path))], "stop", "why", step=3)


LOGGERS = """  # two loggers, the CSV one given init_args
trainer:
  logger:
    - class_path: lightning.pytorch.loggers.TensorBoardLogger
      init_args: {{save_dir: .}}
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {init_args}
"""


FLAT_MAX_KL = """
trainer:
  callbacks:
    - class_path: KLSampleTrainMonitor
      init_args: {max_kl: 0.05}
"""


@pytest.mark.parametrize(
    "override, line",
    [
        (["--model.init_args.sync_every", "0"],
         "model (RLPolicyModule): sync_every: Not of type PositiveInt: does not conform to restriction v>0, got 0"),
        (["--model.init_args.group_size", "many"], "model (RLPolicyModule): group_size: Not of type PositiveInt"),
        (["--model.init_args.no_such_option", "1"], "model (RLPolicyModule): Option 'no_such_option' is not accepted"),
        (["--data.init_args.batch_size", "-3"], "data (PromptDataModule): batch_size: Not of type PositiveInt: -3"),
        (["--trainer.max_steps", "abc"], "trainer.max_steps: Expected a <class 'int'>. Got value: abc"),
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag 1"),
        (["--config", "flat_max_kl.yaml"],  # a key of an options group written flat, as before the groups
         "trainer.callbacks (KLSampleTrainMonitor): Option 'max_kl' is not accepted: it is a field of guard_rail "
         "(guard_rail: {max_kl: ...})"),
        (["--config", "unclosed.yaml"],  # the file, the line and the column, after a config that reads
         "unclosed.yaml, line 3, column 1: while parsing a flow node, did not find expected node content (not YAML)"),
        (["-c", "unclosed.yaml"],  # LightningCLI's short option
         "unclosed.yaml, line 3, column 1: while parsing a flow node, did not find expected node content (not YAML)"),
        (["--trainer", "unclosed_group.yaml"],  # a group's own file
         "unclosed_group.yaml, line 2, column 1: while parsing a flow node"),
        (["--config={a: [}"], "a config file, line 1, column 6: while parsing a flow node"),  # a YAML string given
        (["--config", "logger_field.yaml"],  # in a list of loggers: the logger and its key, not "not a Logger"
         "trainer.logger (CSVLogger): flush_logs_every_n_steps: Expected a <class 'int'>. Got value: abc"),
        (["--config", "one_correction.yaml"],  # a string where a list goes: not "Expected a path"
         "trainer.callbacks (KLSampleTrainMonitor): corrections: Expected a <class 'collections.abc.Sequence'>. Got "
         "value: sequence_mask:3.0, nor the path of a file holding one"),
    ],
    ids=["restriction", "type", "unknown option", "datamodule", "trainer", "unknown flag", "flat group key",
         "not YAML", "-c", "a group's file", "a string that is not YAML", "a logger's key", "a string for a list"],
)
def test_a_config_the_parser_refuses_exits_2_with_one_line_naming_the_key(
    override: list[str], line: str, capsys: Any
) -> None:
    Path("flat_max_kl.yaml").write_text(FLAT_MAX_KL)
    Path("logger_field.yaml").write_text(LOGGERS.format(init_args="{save_dir: ., flush_logs_every_n_steps: abc}"))
    Path("unclosed.yaml").write_text("trainer:\n  max_steps: [\n")
    Path("unclosed_group.yaml").write_text("max_steps: [\n")
    Path("one_correction.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: KLSampleTrainMonitor\n      init_args:\n"
        "        corrections: sequence_mask:3.0\n")
    with pytest.raises(SystemExit) as exit_:
        fit("rl_tiny.yaml", *override)
    assert exit_.value.code == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith(f"loops-callbacks: error: {line}"), error


@pytest.mark.parametrize(
    "override, line",
    [
        (["--model.init_args.sync_every", "0"],
         "model (RLPolicyModule): sync_every: Not of type PositiveInt: does not conform to restriction v>0, got 0"),
        (["--config", "flat_max_kl.yaml"],
         "trainer.callbacks (KLSampleTrainMonitor): Option 'max_kl' is not accepted: it is a field of guard_rail "
         "(guard_rail: {max_kl: ...})"),
        (["--config", "logger_field.yaml"],
         "trainer.logger (CSVLogger): flush_logs_every_n_steps: Expected a <class 'int'>. Got value: abc"),
    ],
    ids=["a key in a class", "a field of a group", "a class in a union"],
)
def test_a_refusal_reads_the_same_when_jsonargparse_words_its_errors_otherwise(
    override: list[str], line: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys, the classes and the alternative of a union that says what is wrong come from jsonargparse's
    exceptions, not from its wording: reading its text lost the class and the union's choice when it changed."""
    from jsonargparse import _typehints

    make_class, reworded = _typehints.raise_unexpected_value, set()

    def class_reworded(message: str, *args: Any, **kwargs: Any) -> Any:
        if message.startswith("Problem with given class_path"):
            reworded.add("class")
        return make_class(message.replace("Problem with given class_path", "Could not make the class"), *args, **kwargs)

    def union_reworded(subtypes: Any, val: Any, exceptions: list[Exception]) -> Any:
        reworded.add("union")
        listed = "".join(f"\n  * {' / '.join(str(error).split(chr(10)))}" for error in exceptions)
        raise ValueError(f"None of the {len(exceptions)} types takes {val!r}:{listed}") from exceptions[0]

    monkeypatch.setattr(_typehints, "raise_unexpected_value", class_reworded)
    monkeypatch.setattr(_typehints, "raise_union_unexpected_value", union_reworded)
    Path("flat_max_kl.yaml").write_text(FLAT_MAX_KL)
    Path("logger_field.yaml").write_text(LOGGERS.format(init_args="{save_dir: ., flush_logs_every_n_steps: abc}"))
    with pytest.raises(SystemExit) as exit_:
        fit("rl_tiny.yaml", *override)
    assert exit_.value.code == 2 and reworded == {"class", "union"}
    (error,) = capsys.readouterr().err.splitlines()
    assert error == f"loops-callbacks: error: {line}", error


GUARD_RAIL = "GuardRail's (max_kl, kl_metric, patience, on_exceed, max_nonfinite_fraction, max_sampling_z)"
MEDIA = "MediaOptions's (log_histogram, max_histogram_tokens, log_worst_tokens, top_n, log_strata, max_groups)"
SCORING = "Scoring's (scoring_dtype, max_tokens_per_batch, reference_fingerprint, scoring_timeout)"
OR_A_FILE = "(or the path of a YAML file holding one)"
RL = ["--config", str(CONFIGS / "rl_tiny.yaml")]


def monitor_config(**init_args: Any) -> str:
    """A config whose KLSampleTrainMonitor has these ``init_args`` (given after rl_tiny.yaml, it replaces its list)."""
    config = {"trainer": {"callbacks": [{"class_path": "KLSampleTrainMonitor", "init_args": init_args}]}}
    Path("monitor.yaml").write_text(yaml.safe_dump(config))
    return "monitor.yaml"


@pytest.mark.parametrize(
    "override, line",
    [
        (lambda: [*RL, "--config", monitor_config(guard_rail=0.05)],
         f"trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a group of options, {GUARD_RAIL}, as in "
         f"guard_rail: {{max_kl: ...}} {OR_A_FILE}; got 0.05"),
        (lambda: [*RL, "--config", monitor_config(guard_rail=[0.05])],
         f"trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a group of options, {GUARD_RAIL}, as in "
         f"guard_rail: {{max_kl: ...}} {OR_A_FILE}; got [0.05]"),
        (lambda: [*RL, "--config", monitor_config(guard_rail=None)],
         f"trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a group of options, {GUARD_RAIL}, as in "
         f"guard_rail: {{max_kl: ...}} {OR_A_FILE}; got null"),
        (lambda: [*RL, "--config", monitor_config(guard_rail="strict")],  # a string is read as a file, then as YAML
         f"trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a group of options, {GUARD_RAIL}, as in "
         f"guard_rail: {{max_kl: ...}} {OR_A_FILE}; got 'strict'"),
        (lambda: [*RL, "--config", monitor_config(media=5)],
         f"trainer.callbacks (KLSampleTrainMonitor): media: takes a group of options, {MEDIA}, as in "
         f"media: {{log_histogram: ...}} {OR_A_FILE}; got 5"),
        (lambda: [*RL, "--trainer.callbacks.init_args.guard_rail", "0.05"],
         f"trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a group of options, {GUARD_RAIL}, as in "
         f"guard_rail: {{max_kl: ...}} {OR_A_FILE}; got '0.05'"),
        (lambda: [*RL, "--trainer.callbacks.init_args.guard_rail=[0.05]"],
         f"trainer.callbacks (KLSampleTrainMonitor): guard_rail: takes a group of options, {GUARD_RAIL}, as in "
         f"guard_rail: {{max_kl: ...}} {OR_A_FILE}; got [0.05]"),
        (lambda: [*RL, "--trainer.callbacks.init_args.media=null"],
         f"trainer.callbacks (KLSampleTrainMonitor): media: takes a group of options, {MEDIA}, as in "
         f"media: {{log_histogram: ...}} {OR_A_FILE}; got null"),
        (lambda: ["--config", dpo_config("pairs.jsonl", scoring=5)],
         f"data (DPODataModule): scoring: takes a group of options, {SCORING}, as in scoring: {{scoring_dtype: ...}} "
         f"{OR_A_FILE}; got 5"),
        (lambda: ["--config", dpo_config("pairs.jsonl"), "--data.init_args.scoring=[bfloat16]"],
         f"data (DPODataModule): scoring: takes a group of options, {SCORING}, as in scoring: {{scoring_dtype: ...}} "
         f"{OR_A_FILE}; got ['bfloat16']"),
        (lambda: [*RL, "--config", "trainer_5.yaml"],  # was silently dropped: the run went on with the default Trainer
         "trainer: takes a group of options, Trainer's (accelerator, strategy, devices, num_nodes, precision, "
         "logger, ...), as in trainer: {accelerator: ...} (or the path of a YAML file holding one); got 5"),
        (lambda: [*RL, "--trainer", "0.05"],
         "trainer: takes a group of options, Trainer's (accelerator, strategy, devices, num_nodes, precision, "
         "logger, ...), as in trainer: {accelerator: ...} (or the path of a YAML file holding one); got '0.05'"),
        (lambda: [*RL, "--model.init_args", "5"],
         "model (RLPolicyModule): init_args: takes a group of options (num_digits, num_symbols, group_size, d_model, "
         "n_layers, n_heads, ...), as in init_args: {num_digits: ...}; got '5'"),
        (lambda: [*RL, "--config", "logger_init_args.yaml"],  # in a list of loggers (a union of one and a list)
         "trainer.logger (CSVLogger): init_args: takes a group of options (save_dir, name, version, prefix, "
         "flush_logs_every_n_steps), as in init_args: {save_dir: ...}; got 5"),
        (lambda: [*RL, "--config", "init_args_list.yaml"],
         "trainer.callbacks (KLSampleTrainMonitor): init_args: takes a group of options (interval, log_every_n_steps, "
         "prefix, guard_rail, media, tokenizer, ...), as in init_args: {interval: ...}; got [0.05]"),
    ],
    ids=["yaml scalar", "yaml list", "yaml null", "yaml string", "media", "override", "override list",
         "override null", "data scoring", "data scoring override", "trainer", "trainer override", "init_args",
         "logger init_args", "init_args list"],
)
def test_a_value_where_a_group_of_options_goes_exits_2_with_one_line_naming_the_key_and_what_it_takes(
    override: Any, line: str, capsys: Any
) -> None:
    """``guard_rail: 0.05`` was a traceback ("argument after ** must be a mapping, not float", exit 1), ``trainer: 5``
    ran with the default Trainer (exit 0), an override read "Unable to load config '0.05'"."""
    Path("trainer_5.yaml").write_text("trainer: 5\n")
    Path("logger_init_args.yaml").write_text(LOGGERS.format(init_args="5"))
    Path("init_args_list.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: KLSampleTrainMonitor\n      init_args: [0.05]\n")
    with pytest.raises(SystemExit) as exit_, seed_messages() as said:
        run_cli(["fit", *override(), "--trainer.logger", "false"])
    assert exit_.value.code == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert said == []  # nothing was made
    assert error.startswith(f"loops-callbacks: error: {line}"), error
    assert not os.path.exists("runs")  # nothing ran


CORRECTION_CLIP_MAX = """
trainer:
  callbacks:
    - class_path: KLSampleTrainMonitor
      init_args: {corrections: [{method: token_mask, params: {clip_max: -1}}]}
"""


@pytest.mark.parametrize(
    "override, line",
    [
        (["--trainer.callbacks.init_args.corrections", "[geo, geo]"],
         "trainer.callbacks[0] (KLSampleTrainMonitor): corrections ['geo'] are listed more than once"),
        (["--trainer.callbacks.init_args.guard_rail.max_kl", "-1"],
         "trainer.callbacks[0].init_args.guard_rail (GuardRail): max_kl must be a number >= 0 or None, got -1.0"),
        (["--trainer.callbacks.init_args.guard_rail.kl_metric", "kl_foo"],
         "trainer.callbacks[0].init_args.guard_rail (GuardRail): kl_metric='kl_foo' is not a metric the monitor logs; "
         "use one"),
        (["--config", "clip_max.yaml"],  # a dataclass in a union (str | Correction) given by its fields
         "trainer.callbacks[0].init_args.corrections[0] (Correction): correction 'token_mask': 'clip_max' must be "
         "positive, got -1.0"),
    ],
    ids=["corrections", "max_kl", "kl_metric", "a dataclass in yaml"],
)
def test_a_value_a_constructor_refuses_exits_2_with_one_line_naming_its_key(
    override: list[str], line: str, capsys: Any
) -> None:
    Path("clip_max.yaml").write_text(CORRECTION_CLIP_MAX)
    with pytest.raises(SystemExit) as exit_, seed_messages() as said:
        fit("rl_tiny.yaml", "--trainer.logger", "false", *override)
    assert exit_.value.code == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert said == []  # not "Seed set to 0" before the refusal: one line in all
    assert error.startswith(f"loops-callbacks: error: {line}"), error
    assert not os.path.exists("runs")  # nothing ran


def test_a_refusal_is_found_when_the_package_was_imported_through_another_spelling_of_its_path() -> None:
    """A benchmark that put ``benchmarks/..`` on ``sys.path`` made frames read ``.../benchmarks/../loops_callbacks``:
    their constructors' refusals were tracebacks instead of one line."""
    import loops_callbacks
    from loops_callbacks.cli.refusals import _made_by_this_package

    package = os.path.dirname(loops_callbacks.__file__)
    spelled = os.path.join(os.path.dirname(package), "benchmarks", "..", "loops_callbacks", "made.py")
    namespace: dict[str, Any] = {}
    exec(compile("class Made:\n    def __init__(self):\n        raise ValueError('no')\n", spelled, "exec"), namespace)
    with pytest.raises(ValueError) as refused:
        namespace["Made"]()
    assert type(_made_by_this_package(refused.value)).__name__ == "Made"


def dpo_config(path: str, **data: Any) -> str:
    config = {
        "trainer": {"logger": False, "max_steps": 1, "enable_checkpointing": False, "enable_progress_bar": False},
        "model": {"class_path": "loops_callbacks.demo.DPOPolicyModule"},
        "data": {"class_path": "DPODataModule", "init_args": {"path": path, "progress": False, **data}},
    }
    Path("dpo.yaml").write_text(yaml.safe_dump(config))
    return "dpo.yaml"


def test_a_data_file_that_is_not_there_exits_2_naming_the_key_and_the_working_directory(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_cli(["fit", "--config", dpo_config("data/pairs.jsonl")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "loops-callbacks: error: data: DPODataModule path='data/pairs.jsonl' does not exist (a relative path is taken "
        f"from the working directory, {os.getcwd()})"
    ]


def test_a_value_refused_once_fit_runs_is_still_an_error() -> None:
    """The phase decides: what a constructor refuses becomes exit 2, what fails in fit stays an exception (exit 1)."""
    Path("pairs.jsonl").write_text('{"chosen": [1, 2, 3], "rejected": [1, 2, 4], "prompt_length": 2}\n' * 2)
    with pytest.raises(ValueError, match="leaves no training pairs"):
        run_cli(["fit", "--config", dpo_config("pairs.jsonl", val_fraction=0.9)])


def test_the_package_classes_have_short_names_and_the_demo_full_paths(tmp_path: Path) -> None:
    (tmp_path / "pairs.jsonl").write_text('{"chosen": [1, 2], "rejected": [1, 3], "prompt_length": 1}\n')
    config = tmp_path / "short.yaml"
    config.write_text(
        "trainer: {logger: false, callbacks: [{class_path: KLSampleTrainMonitor}]}\n"
        "model: {class_path: loops_callbacks.demo.DPOPolicyModule}\n"
        "data: {class_path: DPODataModule, init_args: {path: pairs.jsonl}}\n"
    )
    parsed = LoopsCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                      run=False, args=["--config", str(config)])
    assert [type(c).__name__ for c in parsed.trainer.callbacks if isinstance(c, KLSampleTrainMonitor)] == [
        "KLSampleTrainMonitor"
    ]
    assert type(parsed.datamodule).__name__ == "DPODataModule"
    assert type(parsed.model).__module__.startswith("loops_callbacks.demo")  # named by its full path


def test_the_summary_says_cached_only_when_the_cache_was_written() -> None:
    from types import SimpleNamespace

    from loops_callbacks.cli.summary import reference_lines
    from loops_callbacks.reference import ReferenceLogprobsReport

    def line(**fields: object) -> str:
        report = ReferenceLogprobsReport(source="scored", n_datums=4, scored_here=4, seconds=0.5,
                                         cache_path="/c/ref.cache", cache_status="missing", **fields)
        (text,) = reference_lines(SimpleNamespace(reference_report=report))
        return text

    assert line(cache_written=True).endswith("cached in /c/ref.cache")
    assert "not cached: /c/ref.cache could not be written" in line(cache_written=False)
