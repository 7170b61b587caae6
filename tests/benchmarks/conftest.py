"""The benchmark smoke runs start ahead of their tests, two at a time.

A test marked ``@pytest.mark.benchmark_run(script, *args)`` reads its run from the ``benchmark_run``
fixture. Each run is its own process (one torch thread), forked from a server that has imported torch,
Lightning and the package (``tests.helpers.run_python``: the scripts measure memory and imports in
processes of their own), and mostly keeps one core busy while pytest waits. The first such test of a
module starts every selected one of that module, two at a time in the order of the tests
(``tests.helpers.in_background``), so that both cores work, also through the tests in between (a file
is the unit ``pytest -n`` gives one worker: ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import in_background, run_python, selected_in_this_module

ROOT = Path(__file__).resolve().parents[2]


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
    """This module's selected tests' runs, by test node id, started two at a time in their order."""

    def run(marker: pytest.Mark) -> Callable[[], BenchmarkRun]:
        folder = tmp_path_factory.mktemp(Path(marker.args[0]).stem)
        return lambda: BenchmarkRun(folder, start_benchmark(folder, *marker.args))

    marked = {item.nodeid: item.get_closest_marker("benchmark_run") for item in selected_in_this_module(request)}
    with in_background({nodeid: run(marker) for nodeid, marker in marked.items() if marker is not None}) as runs:
        yield runs


@pytest.fixture
def benchmark_run(request: pytest.FixtureRequest, started_runs: dict[str, Future[BenchmarkRun]]) -> BenchmarkRun:
    """This test's run (its ``benchmark_run`` mark), once it has ended."""
    return started_runs[request.node.nodeid].result()
