"""The reference-logprob cache on disk: a killed writer's temporary file is cleaned up; a hit says so."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from loops_callbacks.reference.across_ranks import score_across_ranks
from loops_callbacks.reference.cache import CACHE_FILE_NAME, CacheKey, read_cache, write_cache
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.types import ModelInput
from tests.helpers import run_python

KEY = CacheKey(reference="r", data="d", dtype="float32")
VALUES = [np.array([-0.5, 0.0]), np.array([0.0])]

KILLED_WRITER = """
    import os, signal, sys
    import numpy as np
    from loops_callbacks.reference.cache import CacheKey, write_cache

    def killed(source, target):  # the process dies between the temporary file and os.replace
        print(os.path.basename(source), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    os.replace = killed
    write_cache(sys.argv[1], CacheKey("r", "d", "float32"), [np.zeros(1000)])
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL and the liveness check are POSIX")
def test_the_next_write_removes_the_temporary_file_of_a_killed_writer(tmp_path: Path) -> None:
    path = tmp_path / CACHE_FILE_NAME
    killed = run_python("-c", textwrap.dedent(KILLED_WRITER), str(path), timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftover = tmp_path / killed.stdout.strip()
    assert leftover.name.startswith(CACHE_FILE_NAME + ".tmp.") and leftover.stat().st_size > 4000
    assert not path.exists()

    write_cache(path, KEY, VALUES)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CACHE_FILE_NAME]
    assert read_cache(path, KEY, [2, 1]).status == "hit"


@pytest.mark.skipif(os.name != "posix", reason="the liveness check is POSIX")
def test_only_temporary_files_of_writers_gone_from_this_host_are_removed(tmp_path: Path) -> None:
    path = tmp_path / CACHE_FILE_NAME
    this_host = _written_temporary_name(tmp_path).rsplit(".", 1)[0]  # <cache>.tmp.<host>
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    removed = [f"{this_host}.{dead.pid}", f"{CACHE_FILE_NAME}.tmp.{dead.pid}"]  # (the latter: names without a host)
    kept = [
        f"{this_host}.{os.getppid()}",  # a live process of this host (the one that started pytest)
        f"{CACHE_FILE_NAME}.tmp.another-host.{dead.pid}",  # another host's writer: its pid means nothing here
        f"{this_host}.notapid",
        f"other.cache.tmp.{dead.pid}",  # another cache's
    ]
    for name in removed + kept:
        (tmp_path / name).write_bytes(b"x")
    write_cache(path, KEY, VALUES)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CACHE_FILE_NAME, *kept])


def _written_temporary_name(directory: Path) -> str:
    """The name write_cache gives its temporary file here (seen through a failing os.replace)."""
    seen = []
    real_replace = os.replace

    def record(source: str, target: str) -> None:
        seen.append(os.path.basename(source))
        raise OSError("stop")

    os.replace = record
    try:
        with pytest.raises(OSError, match="stop"):
            write_cache(directory / "probe.cache", KEY, VALUES)
    finally:
        os.replace = real_replace
    return seen[0].replace("probe.cache", CACHE_FILE_NAME)


class Flat:
    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        return [None] + [-0.5] * (prompt.length - 1)


def test_a_cache_hit_says_so_in_one_line_with_the_count_and_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = [[1, 2, 3], [4, 5]]
    config = ReferenceConfig(cache_dir=str(tmp_path), reference_fingerprint="flat", progress=False)
    with caplog.at_level(logging.INFO):
        _, first = score_across_ranks(tokens, Flat(), config)
        assert first.source == "scored" and "loaded from the cache" not in caplog.text
        _, second = score_across_ranks(tokens, Flat(), config)
    assert second.source == "cache" and second.cache_path == first.cache_path  # the file of this key, beside path
    assert os.path.dirname(str(second.cache_path)) == str(tmp_path)
    lines = [r for r in caplog.records if "loaded from the cache" in r.getMessage()]
    expected = f"Reference logprobs of 2 datums loaded from the cache {second.cache_path} (nothing scored)"
    assert [r.getMessage() for r in lines] == [expected]
    assert lines[0].levelno == logging.INFO and lines[0].name.startswith("lightning.pytorch")  # Lightning's console logger
