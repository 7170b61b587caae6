"""The ``loops-callbacks`` command: LightningCLI with this package's models, data and callbacks.

Every Lightning option works as usual (``fit --config ...``, ``--print_config``, ``--trainer.*``).
The package's own classes can be named by their short names (``class_path: KLSampleTrainMonitor``,
``class_path: DPODataModule``); anything else by its full import path
(``class_path: loops_callbacks.demo.RLPolicyModule``), which is imported only when a config names
it. W&B runs offline unless you set ``WANDB_MODE`` or have logged in, and writes where the config
says even if the working directory changes. After training it prints where the logs are, the one
command that opens the TensorBoard run, and the monitor's last metrics.

Example:
    loops-callbacks fit --config configs/rl_tiny.yaml
    loops-callbacks fit --config configs/rl_tiny.yaml --trainer.max_steps 20
    python -m loops_callbacks fit --config configs/dpo_tiny.yaml --print_config
"""

from __future__ import annotations

import netrc
import os
import shlex
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

import loops_callbacks.data  # noqa: F401  (registers the DataModules for short class names)
import loops_callbacks.models  # noqa: F401  (registers DPOModule and HFDPOModule for short class names)
from loops_callbacks.divergence.monitor import KLSampleTrainMonitor

__all__ = ["LoopsCLI", "main", "run_cli", "run_summary"]


class LoopsCLI(LightningCLI):
    """LightningCLI that reports where the run's logs went and how the sampler and trainer agreed."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                _prepare_wandb(logger)
        _started.extend(trainer.loggers)
        return trainer

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(run_summary(self.trainer), flush=True)
        _finish_wandb(self.trainer.loggers)  # flush the offline run now, so `wandb sync` sees all of it


_started: list[Any] = []  # loggers of the trainers run_cli built, finished however the run ends


def run_summary(trainer: Trainer) -> str:
    """Where each logger wrote, how to look at it, and the monitor's last metrics."""
    lines = [""]
    if trainer.loggers:
        lines.append("Logs:")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            if getattr(logger, "_experiment", None) is None:
                continue  # never started: nothing was written
            run_dir = _shown(os.path.dirname(logger.experiment.dir))
            lines.append(f"  W&B run:      {run_dir}  (offline: upload with `wandb sync {shlex.quote(run_dir)}`)")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"  TensorBoard:  tensorboard --logdir {shlex.quote(_shown(logger.log_dir))}")
        elif isinstance(logger, CSVLogger):
            lines.append(f"  CSV:          {_shown(os.path.join(logger.log_dir, 'metrics.csv'))}")
        else:
            lines.append(f"  {type(logger).__name__}: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    for monitor in (c for c in trainer.callbacks if isinstance(c, KLSampleTrainMonitor)):
        if monitor.last_metrics:
            lines.append(f"Last sampler-vs-trainer divergence ({monitor.prefix}*):")
            for key, value in monitor.last_metrics.items():
                lines.append(f"  {key.removeprefix(monitor.prefix):26s} {value + 0.0:.6g}")  # + 0.0: no "-0"
        if monitor.last_diagnosis is not None:
            lines.append(f"Last logged step, a hint (confidence {monitor.last_diagnosis.confidence:.2f}): "
                         f"{monitor.last_diagnosis.message}")
        if monitor.stop_reason:
            lines.append(f"Stopped by KLSampleTrainMonitor: {monitor.stop_reason}")
    return "\n".join(lines)


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


@contextmanager
def _third_party_warnings_filtered() -> Iterator[None]:
    """Deprecations inside Lightning and its dependencies that a user of this command cannot act on.

    Only for the duration of the command: the library itself never changes warning filters.
    """
    with warnings.catch_warnings():
        # torch deprecated LeafSpec; Lightning's own pytree helper still builds one on every step
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        # jsonargparse APIs that LightningCLI itself still calls
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"lightning\.pytorch\.cli")
        yield


def run_cli(args: Any = None) -> LoopsCLI:
    """Parse ``args`` (default: the command line), run the subcommand, return the CLI object."""
    _wandb_offline_unless_logged_in()
    try:
        with _third_party_warnings_filtered():
            return LoopsCLI(
                LightningModule,
                LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
                args=args,
            )
    finally:
        _finish_wandb(_started)  # also when the run failed: no W&B writes after we return
        _started.clear()


def main(args: Any = None) -> None:
    """Entry point of ``loops-callbacks`` and ``python -m loops_callbacks`` (exit status 0 on success)."""
    run_cli(args)


if __name__ == "__main__":  # pragma: no cover
    main()
