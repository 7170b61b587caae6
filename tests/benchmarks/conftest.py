"""The benchmark smoke runs start ahead of their tests, two at a time.

A test marked ``@pytest.mark.benchmark_run(script, *args)`` reads its run from the ``benchmark_run``
fixture. Each run is its own process (one torch thread), forked from a server that has imported torch,
Lightning and the package (``tests.helpers.run_python``; the scripts measure memory and imports in
processes of their own), that mostly keeps one core busy while pytest waits: the first such test of a module starts every selected one of that module,
two at a time in the order of the tests, so that both cores work, also through the tests in between
(a file is the unit ``pytest -n`` gives one worker: ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import run_python

ROOT = Path(__file__).resolve().parents[2]
AT_ONCE = 2  # the cores of the smallest machine the suite runs on


@dataclass(frozen=True)
class BenchmarkRun:
    """What ``benchmarks/<script> *args`` printed, run in ``folder`` (its working and temporary directory)."""

    folder: Path
    done: subprocess.CompletedProcess[str]

    @property
    def out(self) -> str:
        """Its standard output, once its exit status is checked (0)."""
        assert self.done.returncode == 0, self.done.stdout[-2000:] + self.done.stderr[-3000:]
        return self.done.stdout


def start_benchmark(folder: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "TMPDIR": str(folder)}
    return run_python(str(ROOT / "benchmarks" / script), *args, cwd=folder, env=env, timeout=600)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "benchmark_run(script, *args): the benchmark run the test reads")


@pytest.fixture(scope="module")
def started_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[BenchmarkRun]]]:
    """This module's selected tests' runs, by test node id, started ``AT_ONCE`` at a time in their order."""
    marked = [(item.nodeid, item.get_closest_marker("benchmark_run")) for item in request.session.items
              if getattr(item, "module", None) is request.module]
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:

        def submit(marker: pytest.Mark) -> Future[BenchmarkRun]:
            folder = tmp_path_factory.mktemp(Path(marker.args[0]).stem)
            return pool.submit(lambda: BenchmarkRun(folder, start_benchmark(folder, *marker.args)))

        runs = {nodeid: submit(marker) for nodeid, marker in marked if marker is not None}
        yield runs
        pool.shutdown(cancel_futures=True)


@pytest.fixture
def benchmark_run(request: pytest.FixtureRequest, started_runs: dict[str, Future[BenchmarkRun]]) -> BenchmarkRun:
    """This test's run (its ``benchmark_run`` mark), once it has ended."""
    return started_runs[request.node.nodeid].result()
