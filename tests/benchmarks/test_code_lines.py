"""The code-line count (``benchmarks/code_lines.py``) leaves out blank lines, comments and docstrings only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import code_lines  # noqa: E402


def test_blank_lines_comments_and_docstrings_are_not_code() -> None:
    source = '"""Module."""\n\n# a comment\nx = (1,\n     2)  # counted\nclass A:\n    """Doc\n    more."""\n    y = "not a docstring"\n'
    assert code_lines.count_source(source) == 4  # x = (1, / 2) / class A: / y = ...


def test_the_script_counts_the_package(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_lines.py")], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert " code lines in " in done.stdout and "modules of loops_callbacks/" in done.stdout
