"""Size budget that keeps the structure visible: no source file over 450 lines, no Python
function over 60. Usage: python scripts/check_sizes.py [ROOT ...] (default: the repository's
code folders). Exits 1 and lists every offender."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60
ROOTS = ("kvtier", "tests", "benchmarks", "scripts")
SUFFIXES = (".py", ".cpp", ".sh")


def offenders(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    num_lines = text.count("\n")
    if num_lines > MAX_FILE_LINES:
        found.append(f"{path}: {num_lines} lines (limit {MAX_FILE_LINES})")
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno}: function {node.name} has {length} "
                                 f"lines (limit {MAX_FUNCTION_LINES})")
    return found


def main(roots: list[str]) -> int:
    found = [line for root in roots for path in sorted(Path(root).rglob("*"))
             if path.suffix in SUFFIXES and path.is_file() for line in offenders(path)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(ROOTS)))
