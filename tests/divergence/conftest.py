"""The divergence tests' 2-rank checks share one pair of processes and one process group (``two_ranks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, run_two_ranks


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """The folder each scenario of ``two_ranks`` saved into, and what each rank ended with."""
    from tests.divergence.two_ranks import run_scenarios

    out = tmp_path_factory.mktemp("two_ranks")
    return out, run_two_ranks(run_scenarios, (free_port(), str(out)), out, "the 2-rank scenarios", seconds=600)
