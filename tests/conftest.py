"""Test-wide settings: nothing touches the network, nothing is written outside pytest's tmp dirs, and under
``pytest -n`` each worker (and each process it starts) uses its share of the cores for torch's threads.

Every test starts from the same random state (``seed_each_test``), so what it draws does not depend on
which tests its worker ran before it.

W&B is offline and every directory it writes (runs, service logs, cache, settings) lies in one
session tmp dir; so does Hypothesis's cache, and it keeps no example database. ``.ci/run`` checks that
the suite leaves the checkout as it found it.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy
import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the environment says
os.environ.setdefault("WANDB_SILENT", "true")

settings.register_profile("no-database", database=None)
settings.load_profile("no-database")

_WANDB_DIRS = {
    "WANDB_DIR": "runs",
    "WANDB_CACHE_DIR": "cache",
    "WANDB_CONFIG_DIR": "config",
    "WANDB_DATA_DIR": "data",
    "WANDB_ARTIFACT_DIR": "artifacts",
}


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path setup
def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis writes its cache (``.hypothesis/``) while test modules are collected: in the tmp dir."""
    set_hypothesis_home_dir(config._tmp_path_factory.mktemp("hypothesis"))


_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each worker of ``pytest -n``
if _WORKERS > 1:  # the cores shared out: a worker's torch threads (and its processes') would wait on the others'
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


SLOWEST_FILES = (
    "tests/benchmarks/test_benchmarks_run.py", "tests/cli/test_exit_statuses.py",
    "tests/reference/test_reference_cache_safety.py", "tests/benchmarks/test_heldout_faults.py",
    "tests/models/test_dpo_hf.py", "tests/cli/test_cli.py", "tests/test_real_model.py",
)
"""The files whose tests take longest together (15-70 s each on 2 cores), sent to the workers first so that
none is left for last."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``pytest -n``: one worker runs each file's tests, so that they share the file's fixtures (its 2-rank
    process group, its background runs), and one runs every vLLM file, which share one engine."""
    if config.getvalue("dist") != "loadfile":  # another --dist asked for
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0]
            return "tests/integrations" if file.startswith("tests/integrations/") else file

        def _assign_work_unit(self, node: Any) -> None:
            slowest = SLOWEST_FILES if self.config.option.loadscopereorder else ()  # --no-loadscope-reorder: as given
            for file in reversed(slowest):  # xdist orders the files by their count of tests
                if file in self.workqueue:
                    self.workqueue.move_to_end(file, last=False)
            super()._assign_work_unit(node)

    return ByFile(config, log)


@pytest.fixture(scope="session", autouse=True)
def caches_in_a_tmp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every W&B directory, and every temporary file (``tempfile``: torch's spawn error files among
    them, also in the processes the tests start), in this session's tmp dir."""
    root = tmp_path_factory.mktemp("caches")
    (root / "tmp").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        for variable, name in _WANDB_DIRS.items():
            (root / name).mkdir()
            patch.setenv(variable, str(root / name))
        patch.setenv("TMPDIR", str(root / "tmp"))
        patch.setattr(tempfile, "tempdir", str(root / "tmp"))
        yield
        if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
            sys.modules["wandb"].run.finish()  # a run a failed test left open writes nothing later


@pytest.fixture(autouse=True)
def seed_each_test() -> None:
    """torch's, numpy's and Python's global generators seeded with 0: the schedule of ``pytest -n`` changes
    which tests a worker ran first, and with it what an unseeded ``nn.Linear`` or ``torch.randn`` draws.
    (Not Lightning's ``seed_everything``: it would set ``PL_GLOBAL_SEED`` for the processes a test starts.)"""
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared CPU they cost a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
