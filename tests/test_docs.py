"""The docs site builds with ``mkdocs build --strict`` (every page, every API page rendered from the docstrings),
and every ``python`` code block of its pages runs as written, in a temporary working directory."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from loops_callbacks.conventions import TinkerConventionWarning

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCKS = [
    pytest.param(page, index, block, id=f"{page.name}:{index}")
    for page in sorted(DOCS.glob("*.md"))
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S))
]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS)
def test_every_python_block_runs(page: Path, index: int, block: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes (logs, caches) writes under the test's tmp dir
    if "from vllm import" in block:
        pytest.importorskip("vllm", reason="the block runs a vLLM engine")
        for name in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT"):  # vLLM's own files under the tmp dir too
            monkeypatch.setenv(name, str(tmp_path / name.lower()))
        monkeypatch.setenv("VLLM_NO_USAGE_STATS", "1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("error", TinkerConventionWarning)  # an example's data breaks the convention it shows
        exec(compile(block, f"{page.name}, block {index}", "exec"), {"__name__": "docs"})
