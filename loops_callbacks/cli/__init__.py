"""The ``loops-callbacks`` command: LightningCLI with this package's models, data and callbacks.

Every Lightning option works as usual (``fit --config ...``, ``--print_config``, ``--trainer.*``).
The package's own classes can be named by their short names (``class_path: KLSampleTrainMonitor``,
``class_path: DPODataModule``); anything else by its full import path
(``class_path: loops_callbacks.demo.RLPolicyModule``), which is imported only when a config names
it. A logger's relative ``save_dir`` is taken relative to ``trainer.default_root_dir``, so
``--trainer.default_root_dir`` moves every log. W&B runs offline unless you set ``WANDB_MODE`` or
have logged in, and writes where the config says even if the working directory changes. The last
thing ``fit`` prints, after W&B's shutdown, is the run's summary: where the logs are, the one
command that opens the TensorBoard run, the last logged metrics, where DPO reference logprobs came
from, and each monitor's summary with the guard rail's verdict last.

Exit status (``EXIT_STATUSES``): 0 training ended normally, 1 an error (a missing package is one
line, the last printed), 2 a bad command line or config, 3 the guard rail stopped the run, 4 the
guard rail raised ``SampleTrainDivergenceError``, 130 interrupted by Ctrl-C (the summary so far, then
the step it stopped at), 137 a DDP rank was killed (SIGKILL; 128 + N for signal N: the summary so
far, then the rank and the step).

Examples:
    loops-callbacks fit --config configs/rl_tiny.yaml
    loops-callbacks fit --config configs/rl_tiny.yaml --trainer.max_steps 20 --trainer.default_root_dir /tmp/run
    python -m loops_callbacks fit --config configs/dpo_tiny.yaml --print_config
"""

from __future__ import annotations

import logging
import netrc
import os
import sys
import warnings
from argparse import RawDescriptionHelpFormatter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter, Namespace
from jsonargparse._common import debug_mode_active
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from typing_extensions import override

import loops_callbacks.data  # noqa: F401  (registers the DataModules for short class names)
import loops_callbacks.models  # noqa: F401  (registers DPOModule and HFDPOModule for short class names)
from loops_callbacks.cli.refusals import Constructors, group_value_refusal, init_args_refusal, missing_package
from loops_callbacks.cli.refusals import parse_error_line, refusal_line, unloadable_group, unparsable_config_line
from loops_callbacks.cli.summary import EXIT_ERROR, EXIT_GUARD_RAIL_RAISED, EXIT_INTERRUPTED, EXIT_STATUSES, EXIT_USAGE
from loops_callbacks.cli.summary import exit_status, killed_line, killed_rank, monitors_of, rank_deaths_reported
from loops_callbacks.cli.summary import run_summary, shown, wandb_run_directory
from loops_callbacks.divergence.guard_rail import SampleTrainDivergenceError

__all__ = ["LoopsCLI", "main", "run_cli"]

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The shipped configs: ``configs/`` of the checkout the package is installed from."""

HELP_DESCRIPTION = (
    "loops-callbacks: PyTorch Lightning's command line (LightningCLI) with the loops_callbacks plugins.\n"
    "It runs an RL or DPO experiment from a YAML config: KLSampleTrainMonitor logs the sampler-vs-trainer\n"
    "logprob divergence and stops a run whose sampler broke; DPO data gets its reference logprobs,\n"
    "scored once and cached. Every Lightning option works (--trainer.*, --print_config)."
)
MAIN_COMMANDS = (
    ("loops-callbacks fit --config configs/rl_tiny.yaml", "RL with the divergence monitor (the main demo)"),
    ("loops-callbacks fit --config configs/dpo_tiny.yaml", "DPO with cached reference logprobs"),
    ("loops-callbacks cache list|prune DIR", "see and prune reference-logprob caches (--help for options)"),
)


class _Parser(LightningArgumentParser):
    """Lightning's parser, whose refusal of a config is one line on stderr (exit 2) instead of the usage and a
    many-line error, and which refuses a single value where a group of options goes (it is also the parser of
    every class a config names: jsonargparse makes those of the parser's own type).

    jsonargparse took ``guard_rail: 0.05`` or ``--...guard_rail=[0.05]`` unchecked, and failed on it only when
    making the class (a traceback: "argument after ** must be a mapping"); ``trainer: 5`` was dropped for the
    default Trainer, ``init_args: 5`` read "'int' object has no attribute 'keys'".
    """

    @override
    def parse_args(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)  # a config YAML cannot read is named from these
        return super().parse_args(args, *rest, **kwargs)

    def _check_value_key(self, action: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        """jsonargparse's check of a value a config or an override gives a key; for an options group it checks a
        string only (a file or YAML text of the group), so anything else that is no group is refused here."""
        refused = group_value_refusal(action, value)
        if refused is not None:
            raise TypeError(refused)
        return super()._check_value_key(action, value, *args, **kwargs)  # type: ignore[misc]

    @override
    def parse_object(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        """A class's ``init_args`` are parsed here, by the class's parser: they must be a group of its options."""
        if not isinstance(obj, (dict, Namespace)):  # refused as parse_object refuses what it cannot parse
            options = [name.lstrip("\u200b") for name in vars(self.get_defaults())]  # (jsonargparse marks "keys")
            self.error(init_args_refusal(options, obj))
        return super().parse_object(obj, *args, **kwargs)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        given = getattr(self, "_given", ())
        line = unparsable_config_line(ex, given) or parse_error_line(message, ex, problem=unloadable_group(ex))
        _exit_with(f"loops-callbacks: error: {line}", EXIT_USAGE)


class LoopsCLI(LightningCLI):
    """LightningCLI whose loggers follow ``default_root_dir`` and that records a guard-rail raise or a killed rank."""

    guard_rail_error: SampleTrainDivergenceError | None = None
    killed_rank: tuple[int, int] | None = None  # (rank, signal) of a DDP rank a signal killed during fit

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("description", HELP_DESCRIPTION)
        kwargs.setdefault("epilog", help_epilog())
        kwargs.setdefault("formatter_class", _HelpFormatter)
        return super().init_parser(**kwargs)

    @override
    def _set_seed(self) -> None:
        """Lightning's; its "Seed set to N" is said once the classes are made, so that a refused value is the one
        line a bad config prints."""
        seed_log = logging.getLogger("lightning.fabric.utilities.seed")
        self._seed_records: list[logging.LogRecord] = []
        hold = self._seed_records.append
        seed_log.addFilter(hold)  # a filter that returns None drops the record it kept
        try:
            super()._set_seed()
        finally:
            seed_log.removeFilter(hold)

    @override
    def before_instantiate_classes(self) -> None:
        self._config_as_given = self.config  # what the run's config.yaml saves: save_dir as written
        self.config = self.config.clone()  # the classes are made from this one
        _loggers_under_root_dir(self._subcommand_config().get("trainer"))
        self._constructors = Constructors()
        self.parser.add_instantiator(self._constructors, object)  # after Lightning's for the model and the data

    def _subcommand_config(self) -> Any:
        return self.config.get(self.subcommand) if self.subcommand else self.config

    @override
    def instantiate_classes(self) -> None:
        """Makes the classes; a value a constructor of this package refuses exits 2 with one line naming its key.

        What the constructors raise while fit runs is not caught here: that is still an error (exit 1).
        """
        refused = False
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            line = refusal_line(error, self._constructors.errors, self._subcommand_config())
            if line is None:
                raise
            refused = True
            _exit_with(f"loops-callbacks: error: {line}", EXIT_USAGE)
        finally:  # the seed is said unless the one line of a refusal is all there is to say
            for record in () if refused else getattr(self, "_seed_records", ()):
                logging.getLogger(record.name).handle(record)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        self.config = getattr(self, "_config_as_given", self.config)
        trainer = super().instantiate_trainer(**kwargs)
        if monitors_of(trainer) and _trains_in_spawned_processes(trainer):
            self.parser.error(
                "this strategy (ddp_spawn, ddp_fork or ddp_notebook) trains in processes it starts, which do not "
                "hand KLSampleTrainMonitor's verdict back to this one: the summary and the exit status could not say "
                "whether the guard rail stopped the run. Use --trainer.strategy ddp (the default with several devices)."
            )
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                _prepare_wandb(logger)
        _trainers.append(trainer)
        return trainer

    def fit(self, model: LightningModule, **kwargs: Any) -> None:
        """``trainer.fit``; a guard-rail raise is kept in ``guard_rail_error`` (``run_cli`` raises it again), and a
        failure because a signal killed a DDP rank in ``killed_rank`` (``run_cli`` prints the summary so far)."""
        try:
            with rank_deaths_reported(self.trainer):
                self.trainer.fit(model, **kwargs)
        except SampleTrainDivergenceError as error:
            self.guard_rail_error = error
        except Exception:
            self.killed_rank = killed_rank(self.trainer)
            if self.killed_rank is None:
                raise


class _SaveConfigBesideTheLogs(SaveConfigCallback):
    """Saves each run's ``config.yaml`` beside its own logs: in the version directory of its first CSV or
    TensorBoard logger (``csv/version_3/config.yaml``), else in its W&B run's directory, else in ``default_root_dir``.

    Lightning's ``trainer.log_dir`` is a first W&B logger's ``save_dir``, shared by every run of the
    directory: each run overwrote the one ``config.yaml`` there.
    """

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        versioned = [logger for logger in trainer.loggers if isinstance(logger, (CSVLogger, TensorBoardLogger))]
        wandb = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if versioned:
            versioned[0].experiment  # makes its version directory now: a run started at the same time takes the next
            directory = versioned[0].log_dir
        else:
            directory = wandb_run_directory(wandb[0]) if wandb else trainer.default_root_dir
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self.config_filename)
        self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)


_trainers: list[Trainer] = []  # the trainers run_cli built: their W&B runs are finished, an interrupted one summarized


class _HelpFormatter(RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's formatter, keeping the line breaks of the description and the epilog (argparse's raw one)."""


def help_epilog() -> str:
    """The main commands, the shipped configs (read from ``CONFIGS_DIR`` now) and the exit statuses."""
    lines = ["The two main commands (from the checkout's root):"]
    lines += [f"  {command:54s} {what}" for command, what in MAIN_COMMANDS]
    lines.append("  (add --print_config to see a config with every default, --trainer.max_steps N to shorten it)")
    configs = shipped_configs()
    if configs:
        lines.append(f"\nShipped configs, in {shown(str(CONFIGS_DIR))}:")
        width = max(map(len, configs))
        lines += [f"  {name:{width}s}  {description}" for name, description in configs.items()]
    else:
        lines.append(f"\nThe shipped configs are in the repository's configs/ (not found at {CONFIGS_DIR}).")
    lines.append("\nExit status:")
    lines += [f"  {status}  {meaning}" for status, meaning in EXIT_STATUSES.items()]
    return "\n".join(lines)


def shipped_configs(directory: Path = CONFIGS_DIR) -> dict[str, str]:
    """``{path relative to directory: its first comment line}`` for each YAML config under ``directory``.

    Examples:
        >>> "rl_tiny.yaml" in shipped_configs()
        True
    """
    found = {}
    for path in sorted(directory.glob("*.yaml")) + sorted(directory.glob("*/*.yaml")):
        with open(path, encoding="utf-8") as handle:
            found[path.relative_to(directory).as_posix()] = handle.readline().strip().removeprefix("#").strip()
    return found


def _trains_in_spawned_processes(trainer: Trainer) -> bool:
    """Whether fit runs in child processes (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), not in this one.

    Lightning names no public type for these strategies' launcher; this is the one they all use.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


def _loggers_under_root_dir(trainer_config: Any) -> None:
    """Make each logger's relative ``save_dir`` relative to ``default_root_dir`` (in the parsed config)."""
    root = trainer_config.get("default_root_dir") if trainer_config is not None else None
    loggers = trainer_config.get("logger") if root is not None else None
    if loggers is None or isinstance(loggers, bool):
        return
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = logger.get("init_args") if hasattr(logger, "get") else None
        save_dir = init_args.get("save_dir") if init_args is not None else None
        if isinstance(save_dir, (str, os.PathLike)) and not os.path.isabs(save_dir):
            init_args["save_dir"] = os.path.normpath(os.path.join(os.fspath(root), save_dir))


def _prepare_wandb(logger: WandbLogger) -> None:
    """Before the W&B run starts: an absolute, existing directory, and no ``anonymous`` setting.

    W&B's service process resolves a relative ``dir`` against its own working directory, which is
    wherever the process's first run started: a later run (a test in its own directory, a script
    that changes directory) would write part of its files there. A missing directory also makes
    W&B warn ``git root ... does not exist``, and Lightning always passes ``anonymous`` (``None``
    unless set), which W&B warns has no effect.
    """
    init = getattr(logger, "_wandb_init", None)
    if getattr(logger, "_experiment", None) is not None or not isinstance(init, dict):
        return
    if init.get("anonymous") is None:
        init.pop("anonymous", None)
    if init.get("dir"):
        init["dir"] = logger._save_dir = os.path.abspath(os.fspath(init["dir"]))
        os.makedirs(init["dir"], exist_ok=True)


def _wandb_offline_unless_logged_in() -> None:
    """No account needed: W&B writes offline unless the user chose a mode or has an API key."""
    if "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY"):
        return
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    os.environ["WANDB_MODE"] = "offline"


def _no_litlogger_tip(record: logging.LogRecord) -> bool:
    """Drops Lightning's "try installing litlogger" tip, printed on every run that has no LitLogger."""
    return "litlogger" not in record.getMessage()


@contextmanager
def _third_party_noise_filtered() -> Iterator[None]:
    """Deprecations inside Lightning and its dependencies that a user of this command cannot act on,
    and Lightning's litlogger advertisement.

    Only for the duration of the command: the library itself never changes warning filters.
    """
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_log.addFilter(_no_litlogger_tip)
    try:
        with warnings.catch_warnings():
            # torch deprecated LeafSpec; Lightning's own pytree helper still builds one on every step
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            # jsonargparse APIs that LightningCLI itself still calls (we call two of them as it does)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli")
            deprecated = r"\s*(skip_none parameter|``ArgumentParser.add_instantiator``) was deprecated"
            warnings.filterwarnings("ignore", deprecated, DeprecationWarning)
            yield
    finally:
        rank_zero_log.removeFilter(_no_litlogger_tip)


def _exit_with(line: str, status: int) -> None:
    """Print ``line`` on stderr after what stdout holds, then exit with ``status``."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(status) from None


def run_cli(args: Any = None) -> LoopsCLI:
    """Parse ``args`` (default: the command line), run the subcommand, return the CLI object.

    After ``fit`` (and W&B's shutdown) rank 0 prints ``run_summary``, the last thing of the run; a
    guard-rail ``SampleTrainDivergenceError`` is raised again after it. When a signal N killed a DDP
    rank, the summary so far is followed by the rank and the step, and ``SystemExit(128 + N)``.
    """
    _wandb_offline_unless_logged_in()
    interrupted: Trainer | None = None
    try:
        try:
            with _third_party_noise_filtered():
                cli = LoopsCLI(
                    LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args,
                    save_config_callback=_SaveConfigBesideTheLogs,
                    save_config_kwargs={"overwrite": True, "save_to_log_dir": False}, parser_class=_Parser,
                )
        except SystemExit:  # Lightning exits 1 after a Ctrl-C has shut the run down
            interrupted = next((trainer for trainer in _trainers if trainer.interrupted), None)
            if interrupted is None:
                raise
    finally:  # also when the run failed: no W&B writes after we return
        for logger in (logger for trainer in _trainers for logger in trainer.loggers):
            if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
                logger.experiment.finish()
        _trainers.clear()
    if interrupted is not None:
        if interrupted.is_global_zero:
            print(run_summary(interrupted), flush=True)
            print(f"Interrupted (Ctrl-C) at step {interrupted.global_step}: the run did not finish", flush=True)
        raise SystemExit(EXIT_INTERRUPTED)
    if cli.subcommand == "fit" and cli.trainer.is_global_zero:
        print(run_summary(cli.trainer), flush=True)
    if cli.killed_rank is not None:
        rank, number = cli.killed_rank
        print(killed_line(rank, number, cli.trainer.global_step), flush=True)
        raise SystemExit(128 + number)
    if cli.guard_rail_error is not None:
        raise cli.guard_rail_error
    return cli


def main(args: Any = None) -> None:
    """LightningCLI on ``args`` (default: ``sys.argv[1:]``); exits with ``EXIT_STATUSES``. The ``loops-callbacks``
    command (``loops_callbacks.__main__.main``) runs it for everything but ``cache``."""
    try:
        cli = run_cli(args)
    except SampleTrainDivergenceError:
        raise SystemExit(EXIT_GUARD_RAIL_RAISED) from None  # its message ends the summary just printed
    except Exception as error:
        missing = missing_package(error)
        if missing is None:
            raise
        _exit_with(f"loops-callbacks: error: {missing}", EXIT_ERROR)
    raise SystemExit(exit_status(cli.trainer))
