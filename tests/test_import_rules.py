"""What a module may import, as pyproject.toml's ruff rules say (TID251, TID253): the shared modules
(``loops_callbacks/*.py``) import no wing, and the command imports the demo and the logger backends only
when a config names them. ruff comes with the dev extra. What a fresh process imports is checked in one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str, source: str | None = None) -> subprocess.CompletedProcess[str]:
    rules = ["--select", "TID251,TID253", "--output-format", "concise"]
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", *rules, *args]  # no .ruff_cache in the checkout
    return subprocess.run(command, cwd=ROOT, input=source, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_import_rules() -> None:
    done = ruff("loops_callbacks")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_refuse_a_shared_module_importing_a_wing_and_the_command_importing_the_demo() -> None:
    shared = ruff("--stdin-filename", "loops_callbacks/fields.py", "-", source="import loops_callbacks.divergence\n")
    assert shared.returncode == 1 and "TID251 `loops_callbacks.divergence` is banned" in shared.stdout, shared.stdout
    command = ruff("--stdin-filename", "loops_callbacks/cli/summary.py", "-", source="import wandb\n")
    assert command.returncode == 1 and "TID253 `wandb` is banned at the module level" in command.stdout, command.stdout
    in_a_function = "def log():\n    import wandb\n"  # imported when a config names it: allowed
    assert ruff("--stdin-filename", "loops_callbacks/cli/summary.py", "-", source=in_a_function).returncode == 0


def test_the_plain_functions_and_the_cache_command_run_without_lightning_and_the_cli_without_the_demo_or_a_logger(
    tmp_path: Path,
) -> None:
    probe = (
        "import sys, loops_callbacks\n"
        "from loops_callbacks import loops_compute_kl_sample_train, attach_reference_logprobs\n"
        "from loops_callbacks.__main__ import main\n"
        "try:\n"
        f"    main(['cache', 'list', {str(tmp_path)!r}])\n"
        "except SystemExit as exit_:\n"
        "    assert exit_.code == 0, exit_.code\n"
        "assert 'lightning' not in sys.modules, 'lightning was imported'\n"
        "import loops_callbacks.cli\n"
        "print(sorted(m for m in ('loops_callbacks.demo', 'wandb', 'tensorboard') if m in sys.modules))\n"
        "from loops_callbacks import KLSampleTrainMonitor\n"
        "assert 'lightning' in sys.modules and KLSampleTrainMonitor.__name__ == 'KLSampleTrainMonitor'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"no reference-logprob caches in {tmp_path}", "[]"]
