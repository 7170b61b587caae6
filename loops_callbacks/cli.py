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

Example:
    loops-callbacks fit --config configs/rl_tiny.yaml
    loops-callbacks fit --config configs/rl_tiny.yaml --trainer.max_steps 20 --trainer.default_root_dir /tmp/run
    python -m loops_callbacks fit --config configs/dpo_tiny.yaml --print_config
"""

from __future__ import annotations

import dataclasses
import logging
import netrc
import os
import shlex
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from typing_extensions import override

import loops_callbacks.data  # noqa: F401  (registers the DataModules for short class names)
import loops_callbacks.models  # noqa: F401  (registers DPOModule and HFDPOModule for short class names)
from loops_callbacks.divergence.guard_rail import SampleTrainDivergenceError
from loops_callbacks.divergence.monitor import KLSampleTrainMonitor, Verdict
from loops_callbacks.reference import cache_tool

__all__ = [
    "EXIT_ERROR",
    "EXIT_GUARD_RAIL_RAISED",
    "EXIT_GUARD_RAIL_STOPPED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RANK_KILLED",
    "EXIT_STATUSES",
    "EXIT_USAGE",
    "LoopsCLI",
    "exit_status",
    "main",
    "run_cli",
    "run_summary",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_GUARD_RAIL_STOPPED = 3
EXIT_GUARD_RAIL_RAISED = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_RANK_KILLED = 128 + signal.SIGKILL  # 137, as shells report a process killed by the out-of-memory killer
EXIT_STATUSES = {
    EXIT_OK: "training ended normally (max_steps, max_epochs, or a callback such as EarlyStopping)",
    EXIT_ERROR: "an error (a missing package: one line, the last printed)",
    EXIT_USAGE: "a bad command line or config value",
    EXIT_GUARD_RAIL_STOPPED: "KLSampleTrainMonitor's guard rail stopped the run (on_exceed: stop)",
    EXIT_GUARD_RAIL_RAISED: "KLSampleTrainMonitor's guard rail raised SampleTrainDivergenceError (on_exceed: raise)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C): the summary so far is printed, then 'Interrupted ... at step N'",
    EXIT_RANK_KILLED: "a DDP rank was killed (SIGKILL; 128 + N for signal N): the summary so far, then 'Rank R was "
    "killed by SIGKILL at step N'",
}
"""The command's exit statuses, as ``--help`` and the README list them."""

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The shipped configs: ``configs/`` of the checkout the package is installed from."""

MAIN_COMMANDS = (
    ("loops-callbacks fit --config configs/rl_tiny.yaml", "RL with the divergence monitor (the main demo)"),
    ("loops-callbacks fit --config configs/dpo_tiny.yaml", "DPO with cached reference logprobs"),
)
CACHE_COMMAND = ("loops-callbacks cache list|prune DIR", "see and prune reference-logprob caches (--help for options)")


class LoopsCLI(LightningCLI):
    """LightningCLI whose loggers follow ``default_root_dir`` and that records a guard-rail raise or a killed rank."""

    guard_rail_error: SampleTrainDivergenceError | None = None
    killed_rank: tuple[int, int] | None = None  # (rank, signal) of a DDP rank a signal killed during fit

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("description", help_description())
        kwargs.setdefault("epilog", help_epilog())
        kwargs.setdefault("formatter_class", _HelpFormatter)
        return super().init_parser(**kwargs)

    @override
    def before_instantiate_classes(self) -> None:
        self._config_as_given = self.config  # what the run's config.yaml saves: save_dir as written
        self.config = self.config.clone()  # the classes are made from this one
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config is not None:
            _loggers_under_root_dir(config.get("trainer"))
        self._constructors = _Constructors()
        self.parser.add_instantiator(self._constructors, object)  # after Lightning's for the model and the data

    @override
    def instantiate_classes(self) -> None:
        """Makes the classes; a value a constructor of this package refuses exits 2 with one line naming its key.

        What the constructors raise while fit runs is not caught here: that is still an error (exit 1).
        """
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            refused = _refusal(error, self._constructors.errors)
            if refused is None:
                raise
            made, reason = refused
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            key = _config_key_of(config, made)
            name = type(made).__name__
            message = " ".join(str(reason).split("\n"))
            where = (key or "the config") + ("" if message.startswith(name) else f" ({name})")
            sys.stdout.flush()
            print(f"loops-callbacks: error: {where}: {message}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USAGE) from None

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        self.config = getattr(self, "_config_as_given", self.config)
        trainer = super().instantiate_trainer(**kwargs)
        if _monitors(trainer) and _trains_in_spawned_processes(trainer):
            self.parser.error(
                "this strategy (ddp_spawn, ddp_fork or ddp_notebook) trains in processes it starts, which do not "
                "hand KLSampleTrainMonitor's verdict back to this one: the summary and the exit status could not say "
                "whether the guard rail stopped the run. Use --trainer.strategy ddp (the default with several devices)."
            )
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                _prepare_wandb(logger)
        _started.extend(trainer.loggers)
        _trainers.append(trainer)
        return trainer

    def fit(self, model: LightningModule, **kwargs: Any) -> None:
        """``trainer.fit``; a guard-rail raise is kept in ``guard_rail_error`` (``run_cli`` raises it again), and a
        failure because a signal killed a DDP rank in ``killed_rank`` (``run_cli`` prints the summary so far)."""
        try:
            with _rank_deaths_reported(self.trainer):
                self.trainer.fit(model, **kwargs)
        except SampleTrainDivergenceError as error:
            self.guard_rail_error = error
        except Exception:
            self.killed_rank = _killed_rank(self.trainer)
            if self.killed_rank is None:
                raise


class _SaveConfigBesideTheLogs(SaveConfigCallback):
    """Saves each run's ``config.yaml`` beside its own logs: in the version directory of its first CSV or
    TensorBoard logger (``csv/version_3/config.yaml``), else in its W&B run's directory, else in ``default_root_dir``.

    Lightning's ``trainer.log_dir`` is a first W&B logger's ``save_dir``, shared by every run of the
    directory: each run overwrote the one ``config.yaml`` there.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, save_to_log_dir=False, **kwargs)

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        directory = _run_directory(trainer)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self.config_filename)
        self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)


def _run_directory(trainer: Trainer) -> str:
    """The directory of this run's own logs (rank 0): see ``_SaveConfigBesideTheLogs``."""
    versioned = [logger for logger in trainer.loggers if isinstance(logger, (CSVLogger, TensorBoardLogger))]
    if versioned:
        versioned[0].experiment  # makes its version directory now: a run started at the same time takes the next
        return versioned[0].log_dir
    wandb = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
    return _wandb_run_directory(wandb[0]) if wandb else trainer.default_root_dir


def _wandb_run_directory(logger: WandbLogger) -> str:
    """``<save_dir>/wandb/offline-run-...``, what ``wandb sync`` takes (the run starts if it has not)."""
    return os.path.dirname(logger.experiment.dir)


class _Constructors:
    """jsonargparse's instantiator for every class but the model and the data (Lightning has its own for those),
    keeping each ``ValueError`` / ``TypeError`` a constructor raises.

    jsonargparse chains only the first alternative's error to the one it raises for a union type
    (``str | Correction``), so what a constructor said of a later alternative is found here.
    """

    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def __call__(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except (ValueError, TypeError) as error:
            self.errors.append(error)
            raise


def _refusal(error: BaseException, seen: list[Exception]) -> tuple[object, Exception] | None:
    """The object a constructor of this package was making when it raised a ``ValueError`` / ``TypeError`` that
    ``error`` comes from (its chain of causes, then what ``_Constructors`` saw), and that error."""
    causes: list[BaseException] = []
    while error is not None and error not in causes:
        causes.append(error)
        error = error.__cause__  # type: ignore[assignment]
    for candidate in [*reversed(causes), *seen]:
        made = _made_by_this_package(candidate) if isinstance(candidate, (ValueError, TypeError)) else None
        if made is not None:
            return made, candidate  # type: ignore[return-value]
    return None


_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep


def _made_by_this_package(error: BaseException) -> object | None:
    """The object whose constructor (``__init__``, or a dataclass's ``__post_init__``) in this package raised ``error``:
    the outermost such frame of its traceback."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        code = frame.f_code
        in_package = os.path.realpath(code.co_filename).startswith(_PACKAGE_DIR)  # imported as benchmarks/../ too
        if code.co_name in ("__init__", "__post_init__") and in_package:
            return frame.f_locals.get("self")
    return None


def _config_key_of(config: Any, made: object) -> str | None:
    """Where ``config`` gives the class of ``made``: ``model``, ``trainer.callbacks[0]``, ``...corrections[1]``.

    A ``class_path`` naming its class marks it, or, for a dataclass given by its fields, those
    fields' values.
    """
    for key, node in _config_nodes(config, ""):
        if not isinstance(node, Namespace):
            continue
        fields = {name: value for name, value in vars(node).items() if not name.startswith("__")}  # not __path__
        class_path = fields.get("class_path")
        if isinstance(class_path, str):
            module, _, name = class_path.rpartition(".")
            if getattr(sys.modules.get(module), name, None) is type(made):
                return key
        elif dataclasses.is_dataclass(made) and fields and all(_equal(made, *item) for item in fields.items()):
            return key
    return None


def _equal(made: object, field: str, value: Any) -> bool:
    """Whether ``made`` holds ``value`` as ``field`` (``False`` for what cannot be compared, arrays for instance)."""
    try:
        return bool(hasattr(made, field) and getattr(made, field) == value)
    except (TypeError, ValueError, RuntimeError):
        return False


def _config_nodes(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` for ``value`` and everything in it, keys as a config names them (``trainer.callbacks[0]``)."""
    yield key, value
    if isinstance(value, Namespace):
        for name, item in vars(value).items():
            yield from _config_nodes(item, f"{key}.{name}" if key else name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _config_nodes(item, f"{key}[{index}]")


_started: list[Any] = []  # loggers of the trainers run_cli built, finished however the run ends
_trainers: list[Trainer] = []  # the trainers run_cli built: an interrupted one still gets its summary


class _HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter, keeping the line breaks of the description and the epilog."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def help_description() -> str:
    """What the command is, for ``--help``."""
    return (
        "loops-callbacks: PyTorch Lightning's command line (LightningCLI) with the loops_callbacks plugins.\n"
        "It runs an RL or DPO experiment from a YAML config: KLSampleTrainMonitor logs the sampler-vs-trainer\n"
        "logprob divergence and stops a run whose sampler broke; DPO data gets its reference logprobs,\n"
        "scored once and cached. Every Lightning option works (--trainer.*, --print_config)."
    )


def help_epilog() -> str:
    """The main commands, the shipped configs (read from ``CONFIGS_DIR`` now) and the exit statuses."""
    lines = ["The two main commands (from the checkout's root):"]
    lines += [f"  {command:54s} {what}" for command, what in MAIN_COMMANDS]
    lines.append(f"  {CACHE_COMMAND[0]:54s} {CACHE_COMMAND[1]}")
    lines.append("  (add --print_config to see a config with every default, --trainer.max_steps N to shorten it)")
    configs = shipped_configs()
    if configs:
        lines.append(f"\nShipped configs, in {_shown(str(CONFIGS_DIR))}:")
        width = max(map(len, configs))
        lines += [f"  {name:{width}s}  {description}" for name, description in configs.items()]
    else:
        lines.append(f"\nThe shipped configs are in the repository's configs/ (not found at {CONFIGS_DIR}).")
    lines.append("\nExit status:")
    lines += [f"  {status}  {meaning}" for status, meaning in EXIT_STATUSES.items()]
    return "\n".join(lines)


def shipped_configs(directory: Path = CONFIGS_DIR) -> dict[str, str]:
    """``{path relative to directory: its first comment line}`` for each YAML config under ``directory``.

    Example:
        >>> "rl_tiny.yaml" in shipped_configs()
        True
    """
    found = {}
    for path in sorted(directory.glob("*.yaml")) + sorted(directory.glob("*/*.yaml")):
        with open(path, encoding="utf-8") as handle:
            first = handle.readline().strip()
        found[path.relative_to(directory).as_posix()] = first.removeprefix("#").strip()
    return found


def exit_status(cli: LoopsCLI) -> int:
    """The command's exit status after ``cli`` ran: ``EXIT_GUARD_RAIL_*`` when the guard rail acted, else 0."""
    verdicts = {monitor.verdict for monitor in _monitors(cli.trainer)}
    if cli.guard_rail_error is not None or Verdict.RAISED in verdicts:
        return EXIT_GUARD_RAIL_RAISED
    if Verdict.STOPPED in verdicts:
        return EXIT_GUARD_RAIL_STOPPED
    return EXIT_OK


def run_summary(trainer: Trainer) -> str:
    """Where each logger wrote and how to look at it, the reference, the last metrics, each monitor's summary.

    A monitor's summary (``KLSampleTrainMonitor.summary_lines``) ends with the guard rail's verdict,
    so with a monitor the verdict is the last line.
    """
    lines = [""]
    if trainer.loggers:
        lines.append("Logs:")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            if getattr(logger, "_experiment", None) is None:
                continue  # never started: nothing was written
            run_dir = _shown(_wandb_run_directory(logger))
            lines.append(f"  W&B run:      {run_dir}  (offline: upload with `wandb sync {shlex.quote(run_dir)}`)")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"  TensorBoard:  tensorboard --logdir {shlex.quote(_shown(logger.log_dir))}")
        elif isinstance(logger, CSVLogger):
            lines.append(f"  CSV:          {_shown(os.path.join(logger.log_dir, 'metrics.csv'))}")
        else:
            lines.append(f"  {type(logger).__name__}: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    lines += _reference_lines(getattr(trainer, "datamodule", None))
    monitors = _monitors(trainer)
    lines += _metric_lines(trainer, tuple(m.prefix for m in monitors))
    for monitor in monitors:
        lines += monitor.summary_lines()
    return "\n".join(lines)


def _monitors(trainer: Trainer) -> list[KLSampleTrainMonitor]:
    return [c for c in trainer.callbacks if isinstance(c, KLSampleTrainMonitor)]


PEER_STATUS_WAIT_S = 2.0
"""How long a failed rank 0 waits to read the status of a rank that may have died (see ``_killed_rank``)."""


@contextmanager
def _rank_deaths_reported(trainer: Trainer) -> Iterator[None]:
    """While fit runs, Lightning's watcher of the DDP ranks says which rank a signal killed, and the summary so far,
    before it ends this process.

    The watcher (``_ChildProcessObserver``) SIGKILLs this process within 5 s of a rank's death: a rank 0
    waiting in the store (the reference scoring's stall guard) rather than in a gloo collective never saw an
    error, and ended without a word. Here, rank 0 prints what ``run_cli`` prints after a killed rank, then
    exits 128 + N itself; any other death is the watcher's as before.
    """
    from lightning.fabric.strategies.launchers import subprocess_script

    observer = subprocess_script._ChildProcessObserver
    terminate_all = observer._terminate_all

    def report_then_terminate(watcher: Any) -> None:
        killed = [(rank, -proc.returncode) for rank, proc in enumerate(watcher._child_processes, start=1)
                  if proc.returncode is not None and proc.returncode < 0]
        if not killed or not trainer.is_global_zero:
            return terminate_all(watcher)
        for proc in watcher._child_processes:
            proc.kill()
        rank, number = killed[0]
        with suppress(Exception):  # what can be said: the process ends whatever happens
            print(run_summary(trainer), flush=True)
        print(f"Rank {rank} was killed by {_signal_name(number)} at step {trainer.global_step}: the run did not "
              "finish", flush=True)
        os._exit(128 + number)

    observer._terminate_all = report_then_terminate
    try:
        yield
    finally:
        observer._terminate_all = terminate_all


def _killed_rank(trainer: Trainer) -> tuple[int, int] | None:
    """``(rank, signal)`` of a DDP rank that this process launched and that a signal killed, if one did.

    Its death reaches this process as an error of a collective (gloo: "Connection closed by peer"),
    at times a moment before its status can be read: that is waited for, up to
    ``PEER_STATUS_WAIT_S``. The other ranks are then killed, and Lightning's watcher of the ranks,
    which reads the same list of processes, no longer kills this one (with SIGKILL: no summary).
    """
    launcher = getattr(trainer.strategy, "launcher", None)
    children = getattr(launcher, "procs", None)  # Lightning's subprocess launcher: local ranks 1, 2, ...
    if not children:
        return None
    deadline = time.monotonic() + PEER_STATUS_WAIT_S
    while True:
        statuses = [child.poll() for child in children]
        killed = [(trainer.global_rank + index, -status) for index, status in enumerate(statuses, start=1)
                  if status is not None and status < 0]
        if killed or None not in statuses or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not killed:
        return None
    launcher.kill(signal.SIGKILL)
    children.clear()
    return killed[0]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _trains_in_spawned_processes(trainer: Trainer) -> bool:
    """Whether fit runs in child processes (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), not in this one.

    Lightning names no public type for these strategies' launcher; this is the one they all use.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


def _metric_lines(trainer: Trainer, skip_prefixes: tuple[str, ...]) -> list[str]:
    """The last value of each scalar the module logged (the monitors' own come in their summaries)."""
    values = {
        key: float(value) + 0.0  # + 0.0: no "-0"
        for key, value in trainer.callback_metrics.items()
        if not key.startswith(skip_prefixes) and value.numel() == 1
    }
    if not values:
        return []
    width = max(map(len, values))
    return ["Last logged metrics:"] + [f"  {key:{width}s} {value:.6g}" for key, value in sorted(values.items())]


def _reference_lines(datamodule: Any) -> list[str]:
    """Where a DPO DataModule's reference logprobs came from (loaded from the cache, or scored)."""
    report = getattr(datamodule, "reference_report", None)
    if report is None:
        return []
    where = _shown(report.cache_path) if report.cache_path else None
    if report.source == "cache":
        return [f"Reference logprobs: {report.num_datums} datums loaded from the cache {where} (nothing scored)"]
    if report.cache_written:
        cached = f"cached in {where}"
    elif where and report.cache_status != "off":
        cached = f"not cached: {where} could not be written (see the ReferenceCacheWarning above)"
    else:
        cached = "not cached"
    return [f"Reference logprobs: {report.num_datums} datums scored in {report.seconds:.1f} s "
            f"(cache lookup: {report.cache_status}), {cached}"]


def _loggers_under_root_dir(trainer_config: Any) -> None:
    """Make each logger's relative ``save_dir`` relative to ``default_root_dir`` (in the parsed config)."""
    if trainer_config is None:
        return
    root = trainer_config.get("default_root_dir")
    loggers = trainer_config.get("logger")
    if root is None or loggers is None or isinstance(loggers, bool):
        return
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = logger.get("init_args") if hasattr(logger, "get") else None
        save_dir = init_args.get("save_dir") if init_args is not None else None
        if isinstance(save_dir, (str, os.PathLike)) and not os.path.isabs(save_dir):
            init_args["save_dir"] = os.path.normpath(os.path.join(os.fspath(root), save_dir))


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else absolute."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    return absolute if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


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
        directory = os.path.abspath(os.fspath(init["dir"]))
        os.makedirs(directory, exist_ok=True)
        init["dir"] = directory
        logger._save_dir = directory


def _finish_wandb(loggers: Iterable[Any]) -> None:
    for logger in loggers:
        if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
            logger.experiment.finish()


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


class _NoLitLoggerTip(logging.Filter):
    """Drops Lightning's "try installing litlogger" tip, printed on every run that has no LitLogger."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


@contextmanager
def _third_party_noise_filtered() -> Iterator[None]:
    """Deprecations inside Lightning and its dependencies that a user of this command cannot act on,
    and Lightning's litlogger advertisement.

    Only for the duration of the command: the library itself never changes warning filters.
    """
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    tip_filter = _NoLitLoggerTip()
    rank_zero_log.addFilter(tip_filter)
    try:
        with warnings.catch_warnings():
            # torch deprecated LeafSpec; Lightning's own pytree helper still builds one on every step
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            # jsonargparse APIs that LightningCLI itself still calls (we call two of them as it does)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli")
            warnings.filterwarnings(
                "ignore", r"\s*(skip_none parameter|``ArgumentParser.add_instantiator``) was deprecated", DeprecationWarning
            )
            yield
    finally:
        rank_zero_log.removeFilter(tip_filter)


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
                    LightningModule,
                    LightningDataModule,
                    subclass_mode_model=True,
                    subclass_mode_data=True,
                    save_config_callback=_SaveConfigBesideTheLogs,
                    save_config_kwargs={"overwrite": True},
                    args=args,
                )
        except SystemExit:  # Lightning exits 1 after a Ctrl-C has shut the run down
            interrupted = next((trainer for trainer in _trainers if trainer.interrupted), None)
            if interrupted is None:
                raise
    finally:
        _finish_wandb(_started)  # also when the run failed: no W&B writes after we return
        _started.clear()
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
        print(f"Rank {rank} was killed by {_signal_name(number)} at step {cli.trainer.global_step}: the run did not "
              "finish", flush=True)
        raise SystemExit(128 + number)
    if cli.guard_rail_error is not None:
        raise cli.guard_rail_error
    return cli


def main(args: Any = None) -> None:
    """Entry point of ``loops-callbacks`` and ``python -m loops_callbacks``; exits with ``EXIT_STATUSES``.

    ``loops-callbacks cache list|prune DIR ...`` sees and prunes reference-logprob caches
    (``loops_callbacks.reference.cache_tool``) instead of running LightningCLI.
    """
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)) and argv[:1] == ["cache"]:
        raise SystemExit(cache_tool.main(list(argv[1:])))
    try:
        cli = run_cli(args)
    except SampleTrainDivergenceError:
        raise SystemExit(EXIT_GUARD_RAIL_RAISED) from None  # its message ends the summary just printed
    except Exception as error:
        missing = _missing_package(error)
        if missing is None:
            raise
        sys.stdout.flush()
        print(f"loops-callbacks: error: {missing}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ERROR) from None
    raise SystemExit(exit_status(cli))


def _missing_package(error: BaseException) -> ImportError | None:
    """The ImportError that caused ``error`` (jsonargparse wraps one raised while making a class), if any.

    Only explicit causes (``raise ... from``) are followed: an ImportError merely being handled
    when another error happened is not what went wrong.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ImportError):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


if __name__ == "__main__":  # pragma: no cover
    main()
