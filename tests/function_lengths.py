"""The longest functions of some modules (issue 22: no domain function over 60 lines, data literals excepted).

``python -m tests.function_lengths payments/outbound/protocol.py …`` prints
each module's functions over a threshold (default 40 lines), longest first.
A function's length runs from its ``def`` (decorators excluded) to its last
line, docstring included.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def lengths(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in the module at ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(tree, "")
    return found


def main(argv: list[str]) -> int:
    """Print the functions over the threshold (``--over N``) in the given files, longest first."""
    over = 40
    if argv[:1] == ["--over"]:
        over, argv = int(argv[1]), argv[2:]
    rows = sorted(((n, f"{p}:{name}") for p in argv for n, name in lengths(Path(p))), reverse=True)
    for n, where in rows:
        if n > over:
            print(f"{n:4d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
