"""The ``loops-callbacks`` command: LightningCLI with this package's models, data and callbacks.

Every Lightning option works as usual (``fit --config ...``, ``--print_config``, ``--trainer.*``);
this package is imported first, so YAML can name its classes by their short names
(``class_path: KLSampleTrainMonitor``). W&B runs offline unless you set ``WANDB_MODE`` or have
logged in. After training it prints where the logs are and the last divergence metrics.

Example:
    loops-callbacks fit --config configs/rl_tiny.yaml
    loops-callbacks fit --config configs/rl_tiny.yaml --trainer.max_steps 20
    python -m loops_callbacks fit --config configs/dpo_tiny.yaml --print_config
"""

from __future__ import annotations

import netrc
import os
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

import loops_callbacks.data  # noqa: F401  (registers the DataModules for short class names)
import loops_callbacks.demo  # noqa: F401  (registers the demo models and data)
from loops_callbacks.divergence.monitor import KLSampleTrainMonitor

__all__ = ["LoopsCLI", "main", "run_cli"]


class LoopsCLI(LightningCLI):
    """LightningCLI that reports where the run's logs went and how the sampler and trainer agreed."""

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(run_summary(self.trainer), flush=True)
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger) and logger._experiment is not None:
                logger.experiment.finish()  # flush the offline run now, so `wandb sync` sees all of it


def run_summary(trainer: Trainer) -> str:
    """Where each logger wrote, how to look at it, and the monitor's last metrics."""
    lines = ["", "Logs:"]
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            run_dir = os.path.dirname(logger.experiment.dir)
            lines.append(f"  W&B run:      {run_dir}  (offline: upload with `wandb sync {run_dir}`)")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"  TensorBoard:  tensorboard --logdir {logger.log_dir}")
        elif isinstance(logger, CSVLogger):
            lines.append(f"  CSV:          {os.path.join(logger.log_dir, 'metrics.csv')}")
        else:
            lines.append(f"  {type(logger).__name__}: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    for monitor in (c for c in trainer.callbacks if isinstance(c, KLSampleTrainMonitor)):
        if monitor.last_metrics:
            lines.append(f"Last sampler-vs-trainer divergence ({monitor.prefix}*):")
            for key, value in monitor.last_metrics.items():
                lines.append(f"  {key.removeprefix(monitor.prefix):26s} {value:.6g}")
        if monitor.stop_reason:
            lines.append(f"Stopped by KLSampleTrainMonitor: {monitor.stop_reason}")
    return "\n".join(lines)


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


def run_cli(args: Any = None) -> LoopsCLI:
    """Parse ``args`` (default: the command line), run the subcommand, return the CLI object."""
    _wandb_offline_unless_logged_in()
    return LoopsCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main(args: Any = None) -> None:
    """Entry point of ``loops-callbacks`` and ``python -m loops_callbacks`` (exit status 0 on success)."""
    run_cli(args)


if __name__ == "__main__":  # pragma: no cover
    main()
