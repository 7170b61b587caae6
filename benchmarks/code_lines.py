"""Lines of code in a package: non-blank lines that are neither comments nor docstrings, per module.

``python benchmarks/code_lines.py`` counts ``loops_callbacks/`` and prints the total, the module
count and the largest modules; ``--all`` lists every module. A docstring is a string expression
that is the first statement of a module, class or function (what ``ast.get_docstring`` reads), or
an attribute docstring (PEP 257: a string right after an assignment in a module, a class or an
``__init__``, which mkdocstrings renders as the attribute's documentation); a comment line is one
whose first token is ``#``.

Example:
    >>> count_source("'Doc.'\\n\\n# a comment\\nx = 1  # counted\\n'x, documented.'\\ndef f():\\n    'Doc.'\\n    return x\\n")
    3
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def count_source(source: str) -> int:
    """Code lines of one module's ``source`` (module docstring)."""
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        holds_attributes = isinstance(node, (ast.Module, ast.ClassDef)) or node.name == "__init__"
        for before, statement in zip([None, *node.body], node.body):
            first = before is None
            after_assignment = holds_attributes and isinstance(before, (ast.Assign, ast.AnnAssign))
            if (first or after_assignment) and _is_string(statement):
                docstring_lines.update(range(statement.lineno, statement.end_lineno + 1))
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
            continue
        code_lines.update(range(token.start[0], token.end[0] + 1))
    return len(code_lines - docstring_lines)


def _is_string(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(
        statement.value.value, str)


def count_package(package: Path) -> dict[str, int]:
    """Code lines per module of ``package`` (paths relative to its parent), largest first."""
    counts = {str(path.relative_to(package.parent)): count_source(path.read_text()) for path in package.rglob("*.py")}
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", default=str(ROOT / "loops_callbacks"))
    parser.add_argument("--all", action="store_true", help="list every module")
    args = parser.parse_args()
    counts = count_package(Path(args.package))
    print(f"{sum(counts.values())} code lines in {len(counts)} modules of {Path(args.package).name}/")
    for name, lines in list(counts.items())[: None if args.all else 10]:
        print(f"  {lines:5d}  {name}")


if __name__ == "__main__":
    sys.exit(main())
