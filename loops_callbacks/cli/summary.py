"""What ``fit`` prints last: where each logger wrote and how to open it, where DPO reference logprobs came from,
the last logged metrics and each monitor's summary, the guard rail's verdict last; and the exit status that follows."""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from loops_callbacks.divergence.monitor import KLSampleTrainMonitor, Verdict

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

PEER_STATUS_WAIT_S = 2.0
"""How long a failed rank 0 waits to read the status of a rank that may have died (see ``killed_rank``)."""


def run_summary(trainer: Trainer) -> str:
    """Where each logger wrote and how to look at it, the reference, the last metrics, each monitor's summary.

    A monitor's summary (``KLSampleTrainMonitor.summary_lines``) ends with the guard rail's verdict,
    so with a monitor the verdict is the last line.
    """
    lines = ["", "Logs:"] if trainer.loggers else [""]
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            if getattr(logger, "_experiment", None) is None:
                continue  # never started: nothing was written
            run_dir = shown(wandb_run_directory(logger))
            lines.append(f"  W&B run:      {run_dir}  (offline: upload with `wandb sync {shlex.quote(run_dir)}`)")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"  TensorBoard:  tensorboard --logdir {shlex.quote(shown(logger.log_dir))}")
        elif isinstance(logger, CSVLogger):
            lines.append(f"  CSV:          {shown(os.path.join(logger.log_dir, 'metrics.csv'))}")
        else:
            lines.append(f"  {type(logger).__name__}: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    lines += reference_lines(getattr(trainer, "datamodule", None))
    monitors = monitors_of(trainer)
    values = {  # the last value of each scalar the module logged (the monitors' own come in their summaries)
        key: float(value) + 0.0  # + 0.0: no "-0"
        for key, value in trainer.callback_metrics.items()
        if not key.startswith(tuple(m.prefix for m in monitors)) and value.numel() == 1
    }
    if values:
        width = max(map(len, values))
        lines += ["Last logged metrics:"] + [f"  {key:{width}s} {value:.6g}" for key, value in sorted(values.items())]
    for monitor in monitors:
        lines += monitor.summary_lines()
    return "\n".join(lines)


def reference_lines(datamodule: Any) -> list[str]:
    """Where a DPO DataModule's reference logprobs came from (loaded from the cache, or scored)."""
    report = getattr(datamodule, "reference_report", None)
    if report is None:
        return []
    where = shown(report.cache_path) if report.cache_path else None
    if report.source == "cache":
        return [f"Reference logprobs: {report.n_datums} datums loaded from the cache {where} (nothing scored)"]
    if report.cache_written:
        cached = f"cached in {where}"
    elif where and report.cache_status != "off":
        cached = f"not cached: {where} could not be written (see the ReferenceCacheWarning above)"
    else:
        cached = "not cached"
    return [f"Reference logprobs: {report.n_datums} datums scored in {report.seconds:.1f} s "
            f"(cache lookup: {report.cache_status}), {cached}"]


def exit_status(trainer: Trainer) -> int:
    """The command's exit status after a ``fit`` that returned: ``EXIT_GUARD_RAIL_*`` when the guard rail acted, else
    0 (a ``SampleTrainDivergenceError`` that ended fit is ``EXIT_GUARD_RAIL_RAISED`` in ``main``)."""
    verdicts = {monitor.verdict for monitor in monitors_of(trainer)}
    if Verdict.RAISED in verdicts:
        return EXIT_GUARD_RAIL_RAISED
    return EXIT_GUARD_RAIL_STOPPED if Verdict.STOPPED in verdicts else EXIT_OK


def monitors_of(trainer: Trainer) -> list[KLSampleTrainMonitor]:
    return [c for c in trainer.callbacks if isinstance(c, KLSampleTrainMonitor)]


def killed_rank(trainer: Trainer) -> tuple[int, int] | None:
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


def killed_line(rank: int, number: int, step: int) -> str:
    """The line printed last after a signal killed a DDP rank: ``Rank 1 was killed by SIGKILL at step 4: ...``."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"Rank {rank} was killed by {name} at step {step}: the run did not finish"


@contextmanager
def rank_deaths_reported(trainer: Trainer) -> Iterator[None]:
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
        print(killed_line(rank, number, trainer.global_step), flush=True)
        os._exit(128 + number)

    observer._terminate_all = report_then_terminate
    try:
        yield
    finally:
        observer._terminate_all = terminate_all


def wandb_run_directory(logger: WandbLogger) -> str:
    """``<save_dir>/wandb/offline-run-...``, what ``wandb sync`` takes (the run starts if it has not)."""
    return os.path.dirname(logger.experiment.dir)


def shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else absolute."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    return absolute if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative
